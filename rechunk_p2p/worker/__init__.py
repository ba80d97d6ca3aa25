"""Worker side of rechunk_p2p: the plugin, per-run state, the data plane and task functions."""
