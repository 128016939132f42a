"""What the tests and benchmarks share, imported as ``tests.support.<module>``:

- :mod:`~tests.support.cluster`: in-process clusters with the bridge on
  (``otel_cluster``, ``spilling_cluster``), their Dask configs, ``Mirrored`` (the
  spans the scheduler exported to memory), ``wait_until``;
- :mod:`~tests.support.tasks`: every function the tests run as a Dask task;
- :mod:`~tests.support.span_tree`: the one span-tree checker, for spans from the
  SDK, the OTLP receiver or Phoenix;
- :mod:`~tests.support.oracle`: Dask's own record against everything the bridge
  exported, after every cluster;
- :mod:`~tests.support.workflows`: seeded programs of Dask steps no one wrote by
  hand, and their runner (``python -m tests.support.workflows SEED``);
- :mod:`~tests.support.callers`: the application around Dask (its tracer, the
  carrier of its context);
- :mod:`~tests.support.metrics`: reading the bridge's in-memory metric reader;
- :mod:`~tests.support.otlp_receiver`: a real OTLP endpoint (gRPC, HTTP, TLS)
  with fault modes, and a black-hole collector;
- :mod:`~tests.support.processes`: ``dask scheduler`` + ``dask worker`` processes
  configured by environment variables only;
- :mod:`~tests.support.backends`: real Prometheus and Arize Phoenix servers;
- :mod:`~tests.support.deploy_checks`: reading and checking what ``deploy/`` ships.

Nothing here imports ``dask_otel`` at module level: a worker process without it
can still unpickle the tasks of :mod:`~tests.support.tasks`.
"""
