"""On a GPU host: one run that checks Shardline on CUDA, printed as one table (and written as
``DIR/gpu_check.json``):

- the NCCL communicator's conformance suite at world size 1 (and 2 with two devices: NCCL
  refuses two ranks on one device), its report in ``DIR/nccl-conformance.json``;
- SmolLM2-135M's greedy tokens (3 chat questions, 32 new tokens, each question alone) on the
  device against HF transformers on the same device and prompt ids: float32 must be equal,
  the agreement of bfloat16 and float16 (``--dtypes``) is reported; with two devices float32
  also at TP=2 (``mp`` executor);
- decode tokens/s beside transformers, in each dtype. Batch 1: between the first and
  the last token of one request of ``--tokens`` tokens (end of sequence ignored), after the
  answers above warmed up. Concurrent: ``--concurrent`` requests at once (transformers: one
  left-padded batched ``generate``), all generated tokens over the wall time;
- the peak device memory of every rank (``collective_rpc`` on the ranks), and of
  transformers, in each case.

    python benchmarks/gpu_check.py --out DIR [--model PATH_OR_NAME] [--device cuda|cpu]
        [--wheels DIR] [--tokens 64] [--concurrent 16] [--dtypes float32,bfloat16,float16]

Installs nothing by hand: where ``shardline`` is not installed, the script installs this
checkout (and the wheels in ``--wheels``, offline, without their dependencies) into a temporary
folder and runs again with it on ``PYTHONPATH``. Every case runs in its own process under a
deadline inside an overall budget (on cuda the run ends within 8 minutes); a case that fails
or runs out of time is a FAILED row with the last lines of its stderr (all its output is in
``DIR/gpu_check.log``). ``--device cpu`` runs the same cases on the CPU with gloo (the NCCL
rows then say why they are skipped, and memory is "-").

``gpu_check.json``: ``passed``, ``wall_s``, ``environment`` (python, torch, its CUDA, the
devices, the driver), ``model``, ``tokens``, ``concurrent``, ``rows`` (the table) and
``parts`` (each process's wall time and figures, or its error).

Exit code 0 when every required check passed (the NCCL suite on cuda, float32 tokens equal)
and no case failed; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import TextIO

REPO = Path(__file__).resolve().parent.parent
RESULT_MARK = "GPU-CHECK-RESULT "
#: Set in the run that follows a bootstrap install: a second bootstrap would loop.
BOOTSTRAPPED = "SHARDLINE_GPU_CHECK_BOOTSTRAPPED"
QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea."]
ANSWER_TOKENS = 32
#: float32 first: its tokens must equal transformers'; the lower precisions report agreement.
DTYPES = ("float32", "bfloat16", "float16")
#: Per device: seconds for everything after the bootstrap install, and at most for one case
#: within that. On cuda the run ends within 8 minutes; on the CPU (which only tests this
#: script) a case can take minutes.
LIMITS_S = {"cuda": (420.0, 120.0), "cpu": (1800.0, 600.0)}
SUITE_TIMEOUT_S = 240.0
#: A part is not started with less than this left of the budget.
MIN_PART_S = 20.0
#: The longest reason a table row shows (the JSON report keeps all of it).
DETAIL_CHARS = 300


# --- Bootstrap: install this checkout where shardline is missing -------------------------


def shardline_installed() -> bool:
    """True when ``shardline`` imports and its built-in plugins are registered (entry points
    of an installed distribution, not a path onto the source tree)."""
    from importlib.metadata import entry_points

    try:
        import shardline  # noqa: F401
    except ImportError:
        return False
    return "nccl" in {entry.name for entry in entry_points(group="shardline.plugins")}


def run_bootstrapped(wheels: str | None) -> int:
    """Install this checkout and ``wheels/*.whl`` (offline, no dependencies) into a temporary
    folder, run this script again with it first on ``PYTHONPATH``, remove it; the exit code
    of that run."""
    if os.environ.get(BOOTSTRAPPED):
        print("shardline is still not importable after installing it", file=sys.stderr)
        return 1
    packages = sorted(str(p) for p in Path(wheels).glob("*.whl")) if wheels else []
    with tempfile.TemporaryDirectory(prefix="shardline-gpu-check-") as target:
        install = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        install += ["--no-build-isolation", "--target", target, *packages, str(REPO)]
        if subprocess.run(install).returncode != 0:
            print("installing shardline failed (pip's message above)", file=sys.stderr)
            return 1
        print(
            f"installed shardline and {len(packages)} wheels into {target} for this run", flush=True
        )
        path = os.pathsep.join(p for p in (target, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path, BOOTSTRAPPED: "1"}
        return subprocess.run([sys.executable, *sys.argv], env=env).returncode


# --- Parts: each runs in its own process and prints one RESULT_MARK line -----------------


def shardline_part(args: argparse.Namespace) -> dict:
    """Greedy answers to QUESTIONS, batch-1 and concurrent decode tokens/s, and every rank's
    peak device memory, on ``args.device`` with ``args.dtype`` at TP=``args.tp``."""
    from shardline.cli.bench_decode import QUESTION
    from shardline.engine import LLM, SamplingParams

    cuda = args.device == "cuda"
    overrides = [
        f"model.path={args.model}",
        f"model.dtype={args.dtype}",
        f"parallel.device={args.device}",
        f"parallel.communicator={'nccl' if cuda else 'gloo'}",
        "parallel.control_communicator=gloo",
        f"parallel.tensor_parallel_size={args.tp}",
        f"parallel.distributed_executor_backend={'uni' if args.tp == 1 else 'mp'}",
    ]
    with LLM(overrides=overrides, environ={}) as llm:
        greedy = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0)
        # One at a time, as transformers runs them: the same shapes, so the same rounding.
        answers = [llm.chat([{"role": "user", "content": q}], greedy)[0] for q in QUESTIONS]
        params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
        stamps: list[float] = []
        llm.chat(
            [{"role": "user", "content": QUESTION}],
            params,
            stream=lambda *_: stamps.append(time.perf_counter()),
        )
        many = [
            [{"role": "user", "content": f"{QUESTION} Version {i}."}]
            for i in range(args.concurrent)
        ]
        started = time.perf_counter()
        outputs = llm.chat(many, params)
        elapsed = time.perf_counter() - started
        peak = llm.engine.executor.collective_rpc(peak_device_memory) if cuda else None
    return {
        "answers": [output.token_ids for output in answers],
        "batch1_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
        "concurrent_tok_s": sum(len(o.token_ids) for o in outputs) / elapsed,
        "peak_bytes": peak,
    }


def peak_device_memory(worker) -> int:
    """The rank's peak CUDA memory allocated by torch, in bytes (sent through
    ``collective_rpc``: with the ``uni`` executor the rank is this process)."""
    import torch

    return torch.cuda.max_memory_allocated(worker.model_runner.device)


def transformers_part(args: argparse.Namespace) -> dict:
    """HF transformers on the same file and device: greedy answers to the same prompt ids
    (Shardline's tokenizer and chat template), batch-1 decode tokens/s timed by a streamer,
    and ``args.concurrent`` prompts as one left-padded batched ``generate``."""
    import torch

    from shardline.cli.bench_decode import QUESTION, load_transformers, token_stamps
    from shardline.weights import load_tokenizer, open_checkpoint

    device = torch.device(args.device)
    tokenizer = load_tokenizer(open_checkpoint(args.model))
    pad = min(tokenizer.eos_token_ids, default=0)

    def prompt(question: str) -> list[int]:
        return tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": question}])
        )

    model = load_transformers(args.model, getattr(torch, args.dtype)).to(device)

    answers = []
    for question in QUESTIONS:
        ids = torch.tensor([prompt(question)], device=device)
        out = model.generate(ids, max_new_tokens=ANSWER_TOKENS, do_sample=False, pad_token_id=pad)
        answers.append(out[0, ids.shape[1] :].tolist())

    fixed = {"max_new_tokens": args.tokens, "min_new_tokens": args.tokens, "do_sample": False}
    stamps = token_stamps()
    model.generate(
        torch.tensor([prompt(QUESTION)], device=device), streamer=stamps, pad_token_id=pad, **fixed
    )
    tokens = stamps.times[1:]  # the first put is the prompt
    prompts = [prompt(f"{QUESTION} Version {i}.") for i in range(args.concurrent)]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    started = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, pad_token_id=pad, **fixed)
    elapsed = time.perf_counter() - started
    return {
        "answers": answers,
        "batch1_tok_s": (len(tokens) - 1) / (tokens[-1] - tokens[0]),
        "concurrent_tok_s": (out.shape[1] - width) * len(prompts) / elapsed,
        "peak_bytes": [torch.cuda.max_memory_allocated(device)] if device.type == "cuda" else None,
    }


PARTS = {"shardline": shardline_part, "transformers": transformers_part}


# --- Driver ------------------------------------------------------------------------------

COLUMNS = {
    "check": "check",
    "status": "status",
    "shardline": "shardline",
    "transformers": "transformers",
    "ratio": "shardline/HF",
    "detail": "detail",
}


class Budget:
    """The run's deadline, ``total_s`` from now, and the longest a case may take."""

    def __init__(self, total_s: float, case_s: float) -> None:
        self.total_s = total_s
        self.case_s = case_s
        self.ends = time.monotonic() + total_s

    def timeout_s(self, limit_s: float | None = None) -> float:
        """What the next case may take: ``limit_s`` (default: ``case_s``), or what is left."""
        return min(limit_s or self.case_s, self.ends - time.monotonic())


def run_process(command: list[str], timeout_s: float, log: TextIO) -> tuple[int | None, str, str]:
    """Run ``command`` in a session of its own, killing that whole process group on timeout.
    The exit code (None after a timeout), stdout and stderr; both are appended to ``log``."""
    process = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
        code: int | None = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        code = None
    log.write(f"$ {' '.join(command)}\n{stdout}{stderr}\n[exit code {code}]\n\n")
    log.flush()
    return code, stdout, stderr


def failure(code: int | None, timeout_s: float, stderr: str) -> str:
    """Why a process failed: its deadline, or its exit code and the last lines of stderr."""
    if code is None:
        return f"did not finish within {timeout_s:.0f} s"
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return f"exit code {code}: " + " | ".join(lines[-3:] or ["no output"])


def run_part(
    args: argparse.Namespace, budget: Budget, log: TextIO, engine: str, dtype: str, tp: int
) -> dict:
    """One part in a fresh process: its result and wall time, or ``error``."""
    timeout_s = budget.timeout_s()
    if timeout_s < MIN_PART_S:
        return {"error": f"not run: the {budget.total_s:.0f} s budget is spent"}
    command = [sys.executable, __file__, "--part", engine, "--dtype", dtype, "--tp", str(tp)]
    command += ["--model", args.model, "--device", args.device]
    command += ["--tokens", str(args.tokens), "--concurrent", str(args.concurrent)]
    started = time.perf_counter()
    code, stdout, stderr = run_process(command, timeout_s, log)
    seconds = round(time.perf_counter() - started, 1)
    for line in stdout.splitlines():
        if line.startswith(RESULT_MARK):
            return {"seconds": seconds, **json.loads(line[len(RESULT_MARK) :])}
    return {"seconds": seconds, "error": failure(code, timeout_s, stderr)}


def run_suite(args: argparse.Namespace, budget: Budget, log: TextIO) -> tuple[list[dict], dict]:
    """The NCCL conformance suite: one row per world size, and how the run went."""
    import torch

    from shardline.registry import Registry

    reason = Registry.load().get("communicator", "nccl").unavailable_reason()
    if reason is not None:
        status = "FAILED" if args.device == "cuda" else "skipped"
        detail = f"nccl unavailable: {reason}"
        return [row("nccl suite", status, detail=detail)], {"unavailable": reason}
    devices = torch.cuda.device_count()
    sizes = [1, 2] if devices >= 2 else [1]
    report = Path(args.out) / "nccl-conformance.json"
    report.unlink(missing_ok=True)
    timeout_s = budget.timeout_s(SUITE_TIMEOUT_S)
    command = [sys.executable, "-m", "shardline.cli.main", "conformance", "nccl"]
    command += ["--world-sizes", ",".join(map(str, sizes)), "--report", str(report)]
    started = time.perf_counter()
    code, _, stderr = run_process(command, timeout_s, log)
    run = {"seconds": round(time.perf_counter() - started, 1), "exit_code": code}
    if not report.is_file():
        return [row("nccl suite", "FAILED", detail=failure(code, timeout_s, stderr))], run
    cases = json.loads(report.read_text())["cases"]
    # A run that ended badly with no failed case (a crash) fails every row.
    clean = code == 0 or any(case["outcome"] == "failed" for case in cases)
    broken = "" if clean else failure(code, timeout_s, stderr)
    rows = [
        suite_row(f"world size {size}", [c for c in cases if c["world_size"] == size], broken)
        for size in sizes
    ]
    if devices < 2:
        why = f"{devices} CUDA device; NCCL needs one device per rank"
        rows.append(row("nccl suite, world size 2", "skipped", detail=why))
    others = [case for case in cases if case["world_size"] not in sizes]
    if others:  # cases of no world size, or of sizes this run does not have
        rows.append(suite_row("other cases", others, broken, none_passed="skipped"))
    return rows, run


def suite_row(label: str, cases: list[dict], broken: str, none_passed: str = "FAILED") -> dict:
    """Outcomes of some of the suite's cases: "FAILED" when one failed or the run was
    ``broken``; ``none_passed`` when none passed."""
    outcomes = Counter(case["outcome"] for case in cases)
    failed = [case["test"].split("::")[-1] for case in cases if case["outcome"] == "failed"]
    detail = ", ".join(f"{n} {outcome}" for outcome, n in sorted(outcomes.items())) or "no cases"
    if failed:
        detail += f"; failed: {', '.join(failed[:3])}{' ...' if len(failed) > 3 else ''}"
    if broken:
        detail += f"; {broken}"
    if failed or broken:
        return row(f"nccl suite, {label}", "FAILED", detail=detail)
    return row(
        f"nccl suite, {label}", "passed" if outcomes["passed"] else none_passed, detail=detail
    )


def row(
    check: str,
    status: str,
    shardline: str = "-",
    transformers: str = "-",
    ratio: str = "-",
    detail: str = "",
) -> dict:
    """One line of the table; status "FAILED" fails the run."""
    return {
        "check": check,
        "status": status,
        "shardline": shardline,
        "transformers": transformers,
        "ratio": ratio,
        "detail": detail,
    }


def part_errors(ours: dict, reference: dict) -> str:
    """Why the Shardline part, the transformers part or both failed ("" if neither did)."""
    failed = [("shardline", ours), ("transformers", reference)]
    return "; ".join(f"{name}: {part['error']}" for name, part in failed if "error" in part)


def token_row(check: str, ours: dict, reference: dict, required: bool) -> dict:
    """Greedy answers compared token by token: all equal is "passed" (``required``) or
    "equal"; otherwise "FAILED" or "differs", naming each answer that differs and where."""
    error = part_errors(ours, reference)
    if error:
        return row(check, "FAILED", detail=error)
    differences = []
    for index, (a, b) in enumerate(zip(ours["answers"], reference["answers"], strict=True), 1):
        if a != b:
            position = next(
                (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)),
            )
            differences.append(f"question {index} first differs at token {position}")
    detail = "; ".join(
        [f"{len(QUESTIONS) - len(differences)}/{len(QUESTIONS)} equal", *differences]
    )
    if differences:
        return row(check, "FAILED" if required else "differs", detail=detail)
    return row(check, "passed" if required else "equal", detail=detail)


def speed_rows(label: str, ours: dict, reference: dict, concurrent: int) -> list[dict]:
    """Batch-1 and concurrent decode tokens/s of both engines, and Shardline/transformers."""
    error = part_errors(ours, reference)
    rows = []
    for key, kind in (
        ("batch1_tok_s", "batch-1"),
        ("concurrent_tok_s", f"{concurrent} concurrent"),
    ):
        a, b = ours.get(key), reference.get(key)
        rows.append(
            row(
                f"decode {label} {kind} tok/s",
                "FAILED" if error else "ok",
                f"{a:.1f}" if a else "-",
                f"{b:.1f}" if b else "-",
                f"{a / b:.2f}" if a and b else "-",
                error,
            )
        )
    return rows


def memory_row(label: str, ours: dict, reference: dict) -> dict:
    """Peak device memory of every rank (in rank order), and of transformers."""

    def mib(part: dict) -> str:
        peaks = part.get("peak_bytes")
        return ", ".join(f"{b / 2**20:.0f}" for b in peaks) + " MiB" if peaks else "-"

    error = part_errors(ours, reference)
    status = "FAILED" if error else "ok"
    return row(f"peak device memory {label}", status, mib(ours), mib(reference), detail=error)


def table(rows: list[dict]) -> str:
    """The rows as text; a failure's reason is cut, and given once for the rows it fails."""
    from shardline.cli.table import render
    from shardline.errors import cut

    lines, said = [], set()
    for r in rows:
        detail = r["detail"]
        if r["status"] == "FAILED":
            detail = "as above" if detail in said else cut(detail, DETAIL_CHARS)
            said.add(r["detail"])
        lines.append([*(r[key] for key in COLUMNS if key != "detail"), detail])
    return render(list(COLUMNS.values()), lines)


def environment(device: str) -> dict:
    """Versions and devices this run saw."""
    import torch

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device": device,
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "driver": None,
    }
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        done = subprocess.run(query, capture_output=True, text=True, check=False)
        info["driver"] = (done.stdout.split() or [None])[0] if done.returncode == 0 else None
    return info


def progress(name: str, part: dict) -> None:
    """One line on stderr as each part ends (a run cut short still shows how far it got)."""
    if "unavailable" in part:
        outcome = "not run"
    else:
        outcome = f"{'FAILED' if 'error' in part else 'done'} ({part.get('seconds', 0)} s)"
    print(f"{name}: {outcome}", file=sys.stderr, flush=True)


def check(args: argparse.Namespace) -> int:
    """Every part in turn, most important first; the table, ``gpu_check.json``, the exit
    code."""
    import torch

    from shardline.catalog import resolve_model_path

    started = time.perf_counter()
    budget = Budget(*LIMITS_S[args.device])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(args.device)
    try:
        args.model = resolve_model_path(args.model)
        model_error = None
    except Exception as error:  # not pulled, no network, ...: the model rows say why
        model_error = f"model {args.model}: {error}"
    plan = [("shardline", "float32", 1), ("transformers", "float32", 1)]
    if args.device == "cuda" and torch.cuda.device_count() >= 2:
        plan.append(("shardline", "float32", 2))
    for dtype in args.dtypes[1:]:
        plan += [("shardline", dtype, 1), ("transformers", dtype, 1)]
    parts: dict[str, dict] = {}
    with open(out / "gpu_check.log", "w", encoding="utf-8") as log:
        rows, parts["nccl suite"] = run_suite(args, budget, log)
        progress("nccl suite", parts["nccl suite"])
        for engine, dtype, tp in plan:
            name = f"{engine} {dtype}" + (f" tp{tp}" if engine == "shardline" else "")
            parts[name] = (
                {"error": model_error}
                if model_error
                else run_part(args, budget, log, engine, dtype, tp)
            )
            progress(name, parts[name])
    for dtype in args.dtypes:
        reference = parts[f"transformers {dtype}"]
        for tp in (1, 2):
            ours = parts.get(f"shardline {dtype} tp{tp}")
            if ours is None:
                continue
            label = f"{dtype} tp{tp}" + (" (mp)" if tp > 1 else "")
            rows.append(token_row(f"tokens {label}", ours, reference, dtype == "float32"))
            rows += speed_rows(label, ours, reference, args.concurrent)
            rows.append(memory_row(label, ours, reference))
    print(table(rows))
    passed = all(r["status"] != "FAILED" for r in rows)
    report = {
        "passed": passed,
        "wall_s": round(time.perf_counter() - started, 1),
        "environment": env,
        "model": args.model,
        "tokens": args.tokens,
        "concurrent": args.concurrent,
        "rows": rows,
        "parts": parts,
    }
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    return 0 if passed else 1


def dtypes(text: str) -> list[str]:
    """``--dtypes``: a comma-separated list of DTYPES starting with float32."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in DTYPES]
    if unknown or not names or names[0] != "float32":
        raise argparse.ArgumentTypeError(
            f"{text!r}: allowed: float32 first, then any of {', '.join(DTYPES[1:])}"
        )
    return names


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", help="folder for gpu_check.json, the suite's report and a log")
    parser.add_argument(
        "--model", default="smollm2-135m", help="GGUF file, HF directory or catalog name"
    )
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda", help="cpu: try this script anywhere"
    )
    parser.add_argument(
        "--wheels", help="folder of wheels to install with shardline when it is missing"
    )
    parser.add_argument(
        "--tokens", type=int, default=64, help="tokens per request in the decode measurements"
    )
    parser.add_argument(
        "--concurrent", type=int, default=16, help="requests at once in the concurrent measurement"
    )
    parser.add_argument(
        "--dtypes",
        type=dtypes,
        default=list(DTYPES),
        help=f"model dtypes to check, float32 first (default: {','.join(DTYPES)})",
    )
    parser.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part:
        print(RESULT_MARK + json.dumps(PARTS[args.part](args)), flush=True)
        return 0
    if args.out is None:
        parser.error("--out DIR is required")
    if args.tokens < 2 or args.concurrent < 1:
        parser.error("--tokens must be at least 2 (a rate needs two), --concurrent at least 1")
    if not shardline_installed():
        return run_bootstrapped(args.wheels)
    return check(args)


if __name__ == "__main__":
    raise SystemExit(main())
