"""The lab machinery: what runs any lab, and knows none of them.

* ``creditlab.lab.protocol``: ``LabConfig``, the ``Lab`` protocol, ``LabOption`` (a lab's own CLI
  flags), ``Table`` and ``run_lab``, which owns the output directory, resume, tables and report.
* ``creditlab.lab.runner``: ``Cell`` (an independent, self-seeding unit of work) and the executors
  (serial, process pool, Ray).
* ``creditlab.lab.store``: the results store, one parquet file per finished cell.
* ``creditlab.lab.report``: summary and paired-difference tables with 95% intervals, and how to read
  them.
* ``creditlab.lab.plotting``: figure helpers shared by the labs' plots.

The labs themselves are in ``creditlab.labs``, the training loops they run in ``creditlab.train``;
this package imports neither.
"""
