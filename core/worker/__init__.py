"""One rank's execution: the Worker (pipeline boundary) and the Llama ModelRunner."""
