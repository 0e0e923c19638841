"""What ``python -m h2o_eval.plot`` writes from a results directory, one module per job: the rows and their tables
(:mod:`~h2o_eval.reports.tables`) and paired verdicts against the full cache (:mod:`~h2o_eval.reports.paired`).
Every module reads the rows of :func:`~h2o_eval.reports.tables.table`; none imports the CLI
(:mod:`h2o_eval.plot`)."""
