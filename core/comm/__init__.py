"""Building blocks for communicator backends: work handles, object and tensor-dict encoding,
rendezvous stores, and collectives built from point-to-point messages."""
