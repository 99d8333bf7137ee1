"""Example third-party Shardline communicator over a key-value store."""
