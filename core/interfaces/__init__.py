"""The contracts every provided part keeps: one small module each, docstrings are the spec."""

from shardline.interfaces.capabilities import Capabilities
from shardline.interfaces.communicator import Communicator, NativeAllReduce, ReduceOp
from shardline.interfaces.communicator_backend import CommunicatorBackend, Rendezvous
from shardline.interfaces.executor import Executor, Host
from shardline.interfaces.intermediate import IntermediateTensors
from shardline.interfaces.model_runner import ModelPlan, ModelRunner, RankMemory
from shardline.interfaces.step import (
    CachedRequest,
    ModelRunnerOutput,
    NewRequest,
    SamplingParams,
    SchedulerOutput,
    TokenLogprobs,
)
from shardline.interfaces.work import Work

__all__ = [
    "CachedRequest",
    "Capabilities",
    "Communicator",
    "CommunicatorBackend",
    "Executor",
    "Host",
    "IntermediateTensors",
    "ModelPlan",
    "ModelRunner",
    "ModelRunnerOutput",
    "NativeAllReduce",
    "NewRequest",
    "RankMemory",
    "ReduceOp",
    "Rendezvous",
    "SamplingParams",
    "SchedulerOutput",
    "TokenLogprobs",
    "Work",
]
