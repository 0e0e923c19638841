"""What ``python -m h2o_eval.plot`` writes from a results directory, one module per job: the rows and their tables
(:mod:`~h2o_eval.reports.tables`), paired verdicts against the full cache (:mod:`~h2o_eval.reports.paired`), the
long-context headline (:mod:`~h2o_eval.reports.headline`), the accuracy-vs-budget figures
(:mod:`~h2o_eval.reports.figures`), the leaderboards (:mod:`~h2o_eval.reports.leaderboards`), the records'
provenance (:mod:`~h2o_eval.reports.provenance`) and logging to W&B (:mod:`~h2o_eval.reports.wandb_log`). Each
imports only those before it in this list; none imports the CLI (:mod:`h2o_eval.plot`)."""
