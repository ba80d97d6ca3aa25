"""Moving pieces between workers: the wire format, the send buffer and its byte limits, and
the data plane that carries batches from one worker to another.

Where it runs: task threads pack and put (:mod:`~rechunk_p2p.transport.wire`,
:meth:`~rechunk_p2p.transport.comm.CommBuffer.put_blocking`); each worker's data-plane loop
sends and receives (:mod:`~rechunk_p2p.transport.comm`,
:mod:`~rechunk_p2p.transport.dataplane`). Depends on nothing of the stores or the worker.
"""
