"""Test and experiment harness, outside the transport path: data sets, small models and in-process training loops.

Nothing under ``dgt.transport``, ``dgt.protocol``, ``dgt.channels``, ``dgt.collectives`` or ``dgt.codecs`` imports
this package; its data sets need scikit-learn (the ``dgt[bench]`` / ``dgt[experiment]`` extras).

- :mod:`dgt.harness.digits`: the scikit-learn digits loaders (each variant keeps the split and scaling its users
  were measured with).
- :mod:`dgt.harness.simulate`: K ranks in one process driving the payload codecs (no transport).
- :mod:`dgt.harness.endpoints`: two endpoints on loopback, connected (``async with connected_pair(...)``).
- :mod:`dgt.harness.groups`: W ranks' groups in one process, closed together (``async with local_groups(...)``).
- :mod:`dgt.harness.offline`: ``OfflineTransport``, a Transport with no peers (a Group for construction checks).
- :mod:`dgt.harness.local_comm`: LGC's Comm with K ranks as threads of one process (``run_threads``).
"""
