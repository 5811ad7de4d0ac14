-- Training curves (paper Figures 4, 5, 7): every logged training metric (SFT, RL and the
-- validation evaluations during RL), long format, one row per (run, stage, iteration, step,
-- metric). kpipe.report.figures picks the metrics each figure shows.
SELECT run, stage, iteration, step, name, value
FROM metric_series
ORDER BY run, stage, name, iteration, step;
