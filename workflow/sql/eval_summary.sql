-- Evaluation summary per run, model, level and turn, over the samples that reached the turn
-- (unlike Fast@p, whose denominator is every trajectory): answer rate (the answer held a program
-- defining ModelNew: status not format_error / generation_error), compile rate (a candidate was
-- extracted and compiled: status not format_error / compilation_error), correctness rate
-- (hacked counts as incorrect), hacking ratio, and the geometric-mean speedup of the correct
-- kernels against eager PyTorch and torch.compile. Both hack definitions, as in Table 1: kpipe's
-- (correct_rate, hacking_ratio: any KernelGym check) and the paper's (hacking_ratio_paper: no Triton
-- kernel ran in train or eval mode; its correctness rate lies in [correct_rate, correct_rate_paper_hi],
-- open by the n_unjudged turns only kpipe's stricter checks rejected: a hack check not the paper's, or an
-- extra correctness check KernelBench's allclose passed). KernelBench's correctness verdict on
-- its own (allclose alone, trajectories.kb_correct): kb_correct_rate; n_kb_changed of its correct turns
-- kpipe's extra checks (relative norm, eval() mode) rejected as mismatches (view kb_verdict_changes lists
-- them). Rows behind a cell:
--   select * from turns where stage = 'eval' and run = ... and model = ... and level = ... and turn = ...
SELECT run, model, level, turn,
       count(*) AS n_samples,
       count_if(status NOT IN ('format_error', 'generation_error')) AS n_answered,
       count_if(status NOT IN ('format_error', 'compilation_error')) AS n_compiled,
       count_if(coalesce(correct, false) AND NOT coalesce(hacked, false)) AS n_correct,
       count_if(coalesce(hacked, false)) AS n_hacked,
       count_if(hacked_paper) AS n_hacked_paper,
       count_if((coalesce(hacked, false) AND NOT hacked_paper)
                OR (coalesce(kb_correct, false) AND NOT coalesce(correct, false) AND status = 'mismatch')) AS n_unjudged,
       count_if(coalesce(kb_correct, false) AND NOT coalesce(hacked, false)) AS n_kb_correct,
       count_if(coalesce(kb_correct, false) AND NOT coalesce(correct, false) AND status = 'mismatch') AS n_kb_changed,
       100.0 * count_if(status NOT IN ('format_error', 'generation_error')) / count(*) AS answer_rate,
       100.0 * count_if(status NOT IN ('format_error', 'compilation_error')) / count(*) AS compile_rate,
       100.0 * count_if(coalesce(correct, false) AND NOT coalesce(hacked, false)) / count(*) AS correct_rate,
       100.0 * count_if(coalesce(kb_correct, false) AND NOT coalesce(hacked, false)) / count(*) AS kb_correct_rate,
       100.0 * count_if(coalesce(hacked, false)) / count(*) AS hacking_ratio,
       100.0 * count_if(hacked_paper) / count(*) AS hacking_ratio_paper,
       100.0 * count_if((coalesce(correct, false) AND NOT coalesce(hacked, false))
                        OR (coalesce(hacked, false) AND NOT hacked_paper)
                        OR (coalesce(kb_correct, false) AND NOT coalesce(correct, false) AND status = 'mismatch'))
           / count(*) AS correct_rate_paper_hi,
       exp(avg(ln(speedup_eager)) FILTER (WHERE correct AND NOT coalesce(hacked, false) AND speedup_eager > 0))
           AS geomean_speedup_eager,
       exp(avg(ln(speedup_compile)) FILTER (WHERE correct AND NOT coalesce(hacked, false) AND speedup_compile > 0))
           AS geomean_speedup_compile
FROM turns
WHERE stage = 'eval'
GROUP BY run, model, level, turn
ORDER BY run, model, level, turn;
