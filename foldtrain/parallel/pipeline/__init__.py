"""Pipeline parallelism: this rank's model chunks, the transport between pipeline ranks, the
per-chunk data-parallel reductions, and the one executor that runs any schedule's action list."""
