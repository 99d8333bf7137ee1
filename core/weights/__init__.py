"""Reading checkpoints so that each rank reads only the parts it keeps."""
