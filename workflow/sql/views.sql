-- Derived views of the kpipe database.
-- The base views (tasks, queries, evals, trajectories, train_metrics) are created over
-- results/<table>/**/*.parquet by kpipe.data.db.build_db before this file runs.

-- Which KernelGym check a hack reason (evals.hack_reasons, kpipe.gym.judge.evaluation) comes from. The
-- paper's one check is `no_triton_launch`: "no Triton kernel executed in training or evaluation mode"
-- (reason "no_triton_launch: no Triton kernel ran in train() / eval() mode"). Every other code is one of
-- kpipe's stricter checks: `static_screen` (reject_findings), `no_triton_launch_timed` (the timed calls
-- launched none), ghost_replay, monkey_patch, side_thread, tensor_subclass, input_mutation,
-- window_output_mismatch (kgym-14: the output of a timing window), integrity; from results before kgym-14 also
-- timed_output_mismatch, timing_inconsistent, speedup_not_reproduced.
CREATE OR REPLACE MACRO hack_check(reason) AS
    CASE WHEN reason LIKE 'static %' THEN 'static_screen'
         WHEN reason LIKE 'no_triton_launch: no Triton kernel ran in %' THEN 'no_triton_launch'
         WHEN reason LIKE 'no_triton_launch:%' THEN 'no_triton_launch_timed'
         ELSE split_part(reason, ':', 1) END;

-- Every turn with its task's KernelBench level and name (queries have no level row here), and for a
-- hacked turn the checks that fired: hack_checks (its hack_check codes, sorted, comma-separated;
-- 'unrecorded' when the evals table has no reasons for it) and hacked_paper
-- (hacked by the paper's definition: its no_triton_launch check fired).
CREATE OR REPLACE VIEW turns AS
WITH reasons AS (
    SELECT key AS eval_key, any_value(hack_reasons) AS hack_reasons FROM evals GROUP BY key
),
checks AS (
    SELECT t.*, r.hack_reasons,
           CASE WHEN coalesce(t.hacked, false) THEN
               coalesce(nullif(array_to_string(list_sort(list_distinct(list_transform(r.hack_reasons, lambda x: hack_check(x)))), ','), ''),
                        'unrecorded') END AS hack_checks
    FROM trajectories t
    LEFT JOIN reasons r USING (eval_key)
)
SELECT c.*, k.level, k.name AS task_name, k.version AS kernelbench_version,
       coalesce(c.hacked, false) AND coalesce(list_contains(string_split(c.hack_checks, ','), 'no_triton_launch'), false)
           AS hacked_paper
FROM checks c
LEFT JOIN tasks k USING (task_id);

-- KernelBench's verdict beside kpipe's: every turn whose candidate KernelBench's allclose alone (atol = rtol =
-- 1e-2, trajectories.kb_correct) accepts but kpipe rejects as a mismatch, and which of kpipe's extra
-- correctness checks did it (docs/kernelgym.md, "Differences from KernelBench's harness"): `relative_norm` (the
-- output's relative error norm above 0.05: zeros or noise on outputs smaller than atol) or `eval_mode`
-- (the module's output in eval() mode differs from the reference's). Counts per stage and model:
--   select stage, model, kpipe_check, count(*) from kb_verdict_changes group by all
CREATE OR REPLACE VIEW kb_verdict_changes AS
WITH diagnostics AS (
    SELECT key AS eval_key, any_value(diagnostic) AS diagnostic FROM evals GROUP BY key
)
SELECT t.run, t.stage, t.iteration, t.model, t.level, t.task_id, t.sample, t.turn, t.status, t.correct, t.kb_correct,
       CASE WHEN d.diagnostic LIKE '%eval() mode%' THEN 'eval_mode'
            WHEN d.diagnostic LIKE '%relative error norm%' THEN 'relative_norm'
            ELSE 'unrecorded' END AS kpipe_check,
       d.diagnostic
FROM turns t
LEFT JOIN diagnostics d USING (eval_key)
WHERE t.kb_correct AND NOT coalesce(t.correct, false) AND t.status = 'mismatch';

-- Training curves: one row per (run, stage, iteration, step, metric).
CREATE OR REPLACE VIEW metric_series AS
SELECT run, stage, iteration, step, name, value
FROM train_metrics
ORDER BY run, stage, iteration, step, name;

-- ---------------------------------------------------------------------------------------
-- Evaluation views (the paper's tables: workflow/sql/table*.sql, stts_curves.sql, ...).
-- Conventions, the same as kpipe.data.metrics (tests/test_fastp_definition.py checks it):
-- * a hacked sample is incorrect, whatever its correctness check said;
-- * Fast@p counts a sample iff it is correct and speedup >= p (KernelBench's fastp: > p);
-- * the denominator at turn t is every (task, sample) trajectory of the group
--   (run, stage, iteration, model): a turn a trajectory never reached counts as incorrect;
-- * a NaN speedup is no speedup.
-- ---------------------------------------------------------------------------------------

-- Every trajectory of the eval, stts, rl_val (RL validation) and budget (Kevin's test-time budget)
-- stages x every turn 1..last_turn of its group. `correct` is kpipe's definition (any check hacked
-- counts as incorrect). The paper's ("hacked" = its no_triton_launch check fired) from the same rows:
-- a turn only kpipe's stricter checks rejected is `unjudged`: a hack check other than the paper's
-- fired, or KernelBench's allclose alone accepted an output kpipe's extra correctness checks (relative
-- norm, eval() mode) rejected as a mismatch. Rejected before timing (a mismatch, a static or
-- pre-timing hack check), its speedup is unknown; rejected after timing (kgym-14: a timing window
-- output check, the integrity checks after the windows), its speedup was measured and counts where
-- KernelGym recorded it (kgym-14 records none yet: such a turn counts as never timed). The paper-definition Fast@p lies between kpipe's (fast_*) and
-- fast_*_paper_hi: kpipe's plus every unjudged turn at its timed speedup, or counted fast when never timed.
CREATE OR REPLACE VIEW sample_turns AS
WITH evaluated AS (
    SELECT run, stage, iteration, model, level, task_id, sample, turn, status, correct, kb_correct, hacked,
           hack_checks, hacked_paper, speedup_eager, speedup_compile,
           (coalesce(hacked, false) AND NOT coalesce(hacked_paper, false))
               OR (coalesce(kb_correct, false) AND NOT coalesce(correct, false) AND status = 'mismatch') AS unjudged
    FROM turns
    WHERE stage IN ('eval', 'stts', 'rl_val', 'budget')
),
horizon AS (
    SELECT run, stage, iteration, model, max(turn) AS last_turn
    FROM evaluated
    GROUP BY run, stage, iteration, model
),
trajectory AS (
    SELECT DISTINCT run, stage, iteration, model, level, task_id, sample FROM evaluated
),
grid AS (
    SELECT t.*, h.last_turn, unnest(range(1, h.last_turn + 1)) AS turn
    FROM trajectory t JOIN horizon h USING (run, stage, iteration, model)
)
SELECT g.run, g.stage, g.iteration, g.model, g.level, g.task_id, g.sample, g.turn, g.last_turn,
       e.turn IS NOT NULL AS reached,
       e.status,
       coalesce(e.hacked, false) AS hacked,
       e.hack_checks,
       coalesce(e.hacked_paper, false) AS hacked_paper,
       coalesce(e.unjudged, false) AS unjudged,
       CASE WHEN e.unjudged THEN coalesce(CASE WHEN NOT isnan(e.speedup_eager) THEN e.speedup_eager END, 'inf'::DOUBLE)
            END AS unjudged_speedup_eager,
       CASE WHEN e.unjudged THEN coalesce(CASE WHEN NOT isnan(e.speedup_compile) THEN e.speedup_compile END, 'inf'::DOUBLE)
            END AS unjudged_speedup_compile,
       coalesce(e.correct, false) AND NOT coalesce(e.hacked, false) AS correct,
       CASE WHEN coalesce(e.correct, false) AND NOT coalesce(e.hacked, false) AND NOT isnan(e.speedup_eager)
            THEN e.speedup_eager END AS speedup_eager,
       CASE WHEN coalesce(e.correct, false) AND NOT coalesce(e.hacked, false) AND NOT isnan(e.speedup_compile)
            THEN e.speedup_compile END AS speedup_compile
FROM grid g
LEFT JOIN evaluated e USING (run, stage, iteration, model, task_id, sample, turn);

-- One row per (trajectory, turn, baseline, history): whether it counts toward Fast@p.
-- history = 'last': the kernel of that turn; 'best': the best correct kernel of turns 1..turn
-- (the paper's † rows, Figure 6 right). source_turn: the turn whose kernel the row stands for.
-- hacked, hacked_paper, hack_checks: the kernel of `turn`; unjudged: that kernel ('last') or one of
-- turns 1..turn ('best') was rejected only by kpipe's stricter checks (see sample_turns).
CREATE OR REPLACE VIEW fastp_samples AS
WITH running AS (
    SELECT *,
           bool_or(correct) OVER history AS best_correct,
           max(speedup_eager) OVER history AS best_eager,
           max(speedup_compile) OVER history AS best_compile,
           arg_max(turn, speedup_eager) OVER history AS best_eager_turn,
           arg_max(turn, speedup_compile) OVER history AS best_compile_turn,
           max(CASE WHEN correct THEN turn END) OVER history AS last_correct_turn,
           bool_or(unjudged) OVER history AS best_unjudged,
           max(unjudged_speedup_eager) OVER history AS best_unjudged_eager,
           max(unjudged_speedup_compile) OVER history AS best_unjudged_compile
    FROM sample_turns
    WINDOW history AS (PARTITION BY run, stage, iteration, model, task_id, sample ORDER BY turn
                       ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)
),
cells AS (
    SELECT run, stage, iteration, model, level, task_id, sample, turn, last_turn, hacked, hacked_paper, hack_checks,
           'eager' AS baseline, 'last' AS history, correct, speedup_eager AS speedup, turn AS source_turn,
           unjudged, unjudged_speedup_eager AS unjudged_speedup
    FROM running
    UNION ALL
    SELECT run, stage, iteration, model, level, task_id, sample, turn, last_turn, hacked, hacked_paper, hack_checks,
           'compile', 'last', correct, speedup_compile, turn, unjudged, unjudged_speedup_compile
    FROM running
    UNION ALL
    SELECT run, stage, iteration, model, level, task_id, sample, turn, last_turn, hacked, hacked_paper, hack_checks,
           'eager', 'best', best_correct, best_eager, coalesce(best_eager_turn, last_correct_turn), best_unjudged,
           best_unjudged_eager
    FROM running
    UNION ALL
    SELECT run, stage, iteration, model, level, task_id, sample, turn, last_turn, hacked, hacked_paper, hack_checks,
           'compile', 'best', best_correct, best_compile, coalesce(best_compile_turn, last_correct_turn), best_unjudged,
           best_unjudged_compile
    FROM running
),
fast AS (
    SELECT *,
           correct AND coalesce(speedup >= 1.0, false) AS fast_1,
           correct AND coalesce(speedup >= 1.2, false) AS fast_1_2,
           correct AND coalesce(speedup >= 1.5, false) AS fast_1_5,
           correct AND coalesce(speedup >= 2.0, false) AS fast_2
    FROM cells
)
SELECT *,
       fast_1 OR coalesce(unjudged_speedup >= 1.0, false) AS fast_1_paper_hi,
       fast_1_2 OR coalesce(unjudged_speedup >= 1.2, false) AS fast_1_2_paper_hi,
       fast_1_5 OR coalesce(unjudged_speedup >= 1.5, false) AS fast_1_5_paper_hi,
       fast_2 OR coalesce(unjudged_speedup >= 2.0, false) AS fast_2_paper_hi
FROM fast;

-- STTS rows with their history strategy split off the model label "<model>@<strategy>"
-- (kpipe.evaluate.stts.stts_model_label).
CREATE OR REPLACE VIEW stts_samples AS
SELECT split_part(model, '@', 1) AS base_model, split_part(model, '@', 2) AS strategy, *
FROM fastp_samples
WHERE stage = 'stts';

-- Where a group's numbers come from, for the figures' titles. timing_kind: the clock of its timed
-- turns, read from the feedback they showed (kpipe.gym.judge.feedback.runtime_lines: "Runtime [GPU, on the
-- judge clock]" or "Runtime [CPU (Triton interpreter; ...)]"); null when no turn was timed. engine: the
-- rollout engine of RL rollouts (their model label is "<run>/rl-iter<k>/<engine>"), else null.
CREATE OR REPLACE VIEW provenance AS
SELECT run, stage, iteration, model,
       CASE WHEN bool_or(feedback LIKE '%Runtime [GPU%')
                 AND bool_or(feedback LIKE '%Runtime [CPU (Triton interpreter%') THEN 'mixed'
            WHEN bool_or(feedback LIKE '%Runtime [GPU%') THEN 'cuda'
            WHEN bool_or(feedback LIKE '%Runtime [CPU (Triton interpreter%') THEN 'cpu' END AS timing_kind,
       nullif(regexp_extract(model, '/rl-iter[0-9]+/([A-Za-z0-9_]+)$', 1), '') AS engine,
       count(*) AS n_turns
FROM trajectories
GROUP BY run, stage, iteration, model;

-- ---------------------------------------------------------------------------------------
-- Column comments. A column with none here takes the meaning of the same-named column of the
-- tables and views its view reads, where they agree on one (kpipe.data.db.inherit_comments); every
-- column whose meaning a view changes, or that is new, has one here (tests/test_db.py checks that
-- every column of every view has a comment).
-- ---------------------------------------------------------------------------------------
COMMENT ON COLUMN turns.task_id IS 'tasks.task_id (evaluation stages) or queries.query_id (training stages)';
COMMENT ON COLUMN turns.status IS 'KernelGym verdict of the turn''s candidate (evals.status); null when no code was evaluated';
COMMENT ON COLUMN turns.correct IS 'the candidate was correct by kpipe''s checks (evals.correct); a hacked candidate may still say true here: sample_turns.correct does not';
COMMENT ON COLUMN turns.kb_correct IS 'KernelBench''s verdict alone (evals.kb_correct): allclose without kpipe''s extra checks; null where no output was compared';
COMMENT ON COLUMN turns.hacked IS 'the candidate was rejected as reward hacking by any of kpipe''s checks (hack_checks says which)';
COMMENT ON COLUMN turns.speedup_eager IS 'speedup of the turn''s candidate over PyTorch eager (evals.speedup_eager)';
COMMENT ON COLUMN turns.speedup_compile IS 'speedup of the turn''s candidate over torch.compile (evals.speedup_compile)';
COMMENT ON COLUMN turns.pr IS 'profiling ratio (paper Eq. 7) of the turn''s candidate';
COMMENT ON COLUMN turns.feedback IS 'the feedback shown to the model after this turn';
COMMENT ON COLUMN turns.hack_checks IS 'hacked turns: the hack_check codes that fired, sorted, comma-separated (''unrecorded'' when evals has no reasons); null otherwise';
COMMENT ON COLUMN turns.hacked_paper IS 'hacked by the paper''s definition: its no_triton_launch check fired';
COMMENT ON COLUMN turns.task_name IS 'KernelBench problem name (tasks.name); null for training queries';
COMMENT ON COLUMN turns.kernelbench_version IS 'KernelBench version of the task (tasks.version); null for training queries';

COMMENT ON COLUMN kb_verdict_changes.task_id IS 'tasks.task_id of the evaluated task';
COMMENT ON COLUMN kb_verdict_changes.status IS 'KernelGym verdict of the turn''s candidate: mismatch here';
COMMENT ON COLUMN kb_verdict_changes.correct IS 'kpipe''s verdict (turns.correct): false or null here';
COMMENT ON COLUMN kb_verdict_changes.kb_correct IS 'KernelBench''s verdict alone (turns.kb_correct): true here';
COMMENT ON COLUMN kb_verdict_changes.kpipe_check IS 'which extra kpipe check rejected it: relative_norm, eval_mode or unrecorded';

COMMENT ON COLUMN provenance.timing_kind IS 'clock of the group''s timed turns: cuda, cpu (Triton interpreter), mixed; null when none was timed';
COMMENT ON COLUMN provenance.engine IS 'rollout engine of RL rollouts (from the model label <run>/rl-iter<k>/<engine>); null otherwise';
COMMENT ON COLUMN provenance.n_turns IS 'turns (trajectories rows) in the group';

COMMENT ON COLUMN sample_turns.task_id IS 'tasks.task_id of the evaluated task';
COMMENT ON COLUMN sample_turns.last_turn IS 'the last turn any trajectory of the group (run, stage, iteration, model) reached: the Fast@p horizon';
COMMENT ON COLUMN sample_turns.reached IS 'the trajectory reached this turn (else the turn counts as incorrect)';
COMMENT ON COLUMN sample_turns.status IS 'KernelGym verdict of the turn''s candidate; null when the turn was not reached';
COMMENT ON COLUMN sample_turns.hacked IS 'the turn''s candidate was rejected as reward hacking (false when not reached)';
COMMENT ON COLUMN sample_turns.hack_checks IS 'hacked turns: the hack_check codes that fired (turns.hack_checks)';
COMMENT ON COLUMN sample_turns.hacked_paper IS 'hacked by the paper''s definition (no_triton_launch fired); false when not reached';
COMMENT ON COLUMN sample_turns.unjudged IS 'rejected only by kpipe''s stricter checks (a hack check not the paper''s, or an extra correctness check KernelBench''s allclose passed): correct under the paper''s definition as far as known';
COMMENT ON COLUMN sample_turns.unjudged_speedup_eager IS 'unjudged turns: the timed speedup over eager where KernelGym recorded one (rejected after timing), else +inf (never timed: counted fast in the upper bound); null otherwise';
COMMENT ON COLUMN sample_turns.unjudged_speedup_compile IS 'unjudged turns: the timed speedup over torch.compile where recorded, else +inf (never timed); null otherwise';
COMMENT ON COLUMN sample_turns.correct IS 'kpipe''s correctness for Fast@p: correct and not hacked (false when not reached)';
COMMENT ON COLUMN sample_turns.speedup_eager IS 'speedup over PyTorch eager of a correct, non-hacked candidate; null otherwise (and for NaN)';
COMMENT ON COLUMN sample_turns.speedup_compile IS 'speedup over torch.compile of a correct, non-hacked candidate; null otherwise (and for NaN)';

COMMENT ON COLUMN fastp_samples.task_id IS 'tasks.task_id of the evaluated task';
COMMENT ON COLUMN fastp_samples.last_turn IS 'the last turn any trajectory of the group reached: the Fast@p horizon';
COMMENT ON COLUMN fastp_samples.hacked IS 'the kernel of `turn` was rejected as reward hacking';
COMMENT ON COLUMN fastp_samples.hacked_paper IS 'the kernel of `turn` is hacked by the paper''s definition (no_triton_launch fired)';
COMMENT ON COLUMN fastp_samples.hack_checks IS 'the hack_check codes that fired on the kernel of `turn`';
COMMENT ON COLUMN fastp_samples.baseline IS 'what the speedup is over: eager (PyTorch) or compile (torch.compile)';
COMMENT ON COLUMN fastp_samples.history IS 'last: the kernel of `turn`; best: the best correct kernel of turns 1..turn (the paper''s † rows)';
COMMENT ON COLUMN fastp_samples.correct IS 'last: the kernel of `turn` is correct and not hacked; best: one of turns 1..turn is';
COMMENT ON COLUMN fastp_samples.speedup IS 'speedup over `baseline` of the kernel the row stands for (correct kernels only; else null)';
COMMENT ON COLUMN fastp_samples.source_turn IS 'the turn whose kernel the row stands for';
COMMENT ON COLUMN fastp_samples.unjudged IS 'that kernel (last) or one of turns 1..turn (best) was rejected only by kpipe''s stricter checks';
COMMENT ON COLUMN fastp_samples.unjudged_speedup IS 'the speedup over `baseline` the paper-definition upper bound credits the unjudged kernel (last) or the best of turns 1..turn (best): timed where recorded, +inf when never timed; null when none is unjudged';
COMMENT ON COLUMN fastp_samples.fast_1_paper_hi IS 'counts toward the paper-definition Fast@1''s upper bound: fast_1, or an unjudged kernel at unjudged_speedup >= 1.0';
COMMENT ON COLUMN fastp_samples.fast_1_2_paper_hi IS 'counts toward the paper-definition Fast@1.2''s upper bound: fast_1_2, or an unjudged kernel at unjudged_speedup >= 1.2';
COMMENT ON COLUMN fastp_samples.fast_1_5_paper_hi IS 'counts toward the paper-definition Fast@1.5''s upper bound: fast_1_5, or an unjudged kernel at unjudged_speedup >= 1.5';
COMMENT ON COLUMN fastp_samples.fast_2_paper_hi IS 'counts toward the paper-definition Fast@2''s upper bound: fast_2, or an unjudged kernel at unjudged_speedup >= 2.0';
COMMENT ON COLUMN fastp_samples.fast_1 IS 'counts toward Fast@1: correct and speedup >= 1.0';
COMMENT ON COLUMN fastp_samples.fast_1_2 IS 'counts toward Fast@1.2: correct and speedup >= 1.2';
COMMENT ON COLUMN fastp_samples.fast_1_5 IS 'counts toward Fast@1.5: correct and speedup >= 1.5';
COMMENT ON COLUMN fastp_samples.fast_2 IS 'counts toward Fast@2: correct and speedup >= 2.0';

COMMENT ON COLUMN stts_samples.base_model IS 'the model, without its STTS strategy (the part of `model` before @)';
COMMENT ON COLUMN stts_samples.strategy IS 'STTS history strategy: full, top_w or best_window (the part of `model` after @)';
