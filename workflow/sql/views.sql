-- Derived views of the kpipe database.
-- The base views (tasks, queries, evals, trajectories, train_metrics) are created over
-- results/<table>/**/*.parquet by kpipe.db.build_db before this file runs.

-- Every turn with its task's KernelBench level and name (queries have no level row here).
CREATE OR REPLACE VIEW turns AS
SELECT t.*, k.level, k.name AS task_name, k.version AS kernelbench_version
FROM trajectories t
LEFT JOIN tasks k USING (task_id);

-- Training curves: one row per (run, stage, iteration, step, metric).
CREATE OR REPLACE VIEW metric_series AS
SELECT run, stage, iteration, step, name, value
FROM train_metrics
ORDER BY run, stage, iteration, step, name;
