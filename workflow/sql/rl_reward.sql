-- RL rollout reward per run and iteration: the learning curve of the rollouts. mean_reward is the
-- mean reward of every turn of the iteration's rollouts (train_metrics' reward_mean; paper Eq. 1: 0 unless
-- correct and not hacked, then 1 + min(speedup, 3); on a CPU the speedups are interpreter timings);
-- reward_lo / reward_hi: a 95% bootstrap interval (1000 replicates) that resamples whole
-- trajectories (task, sample) of the iteration, since the turns of one trajectory are correlated
-- (deterministic: each draw is a hash of the replicate and the draw's position).
-- vs_first: mean_reward minus the run's first iteration's. Turn 1 and last-turn means and the
-- pass and compile rates (percent of turns) say where the reward comes from.
-- Rows behind a cell: select * from turns where stage = 'rl' and run = ... and iteration = ...
WITH trajectory AS (
    SELECT run, iteration, task_id, sample, sum(reward) AS reward_sum, count(*) AS n_turns,
           row_number() OVER (PARTITION BY run, iteration ORDER BY task_id, sample) - 1 AS position
    FROM trajectories
    WHERE stage = 'rl'
    GROUP BY run, iteration, task_id, sample
),
sizes AS (
    SELECT run, iteration, count(*) AS n FROM trajectory GROUP BY run, iteration
),
draws AS (
    SELECT t.run, t.iteration, r.replicate, hash(r.replicate, t.position) % s.n AS pick
    FROM trajectory t
    JOIN sizes s USING (run, iteration)
    CROSS JOIN range(1000) r(replicate)
),
replicates AS (
    SELECT d.run, d.iteration, d.replicate, sum(t.reward_sum) / sum(t.n_turns) AS mean_reward
    FROM draws d
    JOIN trajectory t ON t.run = d.run AND t.iteration = d.iteration AND t.position = d.pick
    GROUP BY d.run, d.iteration, d.replicate
),
bounds AS (
    SELECT run, iteration, quantile_cont(mean_reward, 0.025) AS reward_lo, quantile_cont(mean_reward, 0.975) AS reward_hi
    FROM replicates
    GROUP BY run, iteration
),
turn_stats AS (
    SELECT run, iteration,
           count(DISTINCT (task_id, sample)) AS n_trajectories,
           count(*) AS n_turns,
           avg(reward) AS mean_reward,
           avg(reward) FILTER (WHERE turn = 1) AS reward_turn1,
           avg(reward) FILTER (WHERE turn = max_turn) AS reward_last_turn,
           100.0 * avg(CASE WHEN coalesce(correct, false) AND NOT coalesce(hacked, false) THEN 1 ELSE 0 END) AS pass_rate,
           100.0 * avg(CASE WHEN status NOT IN ('format_error', 'compilation_error') THEN 1 ELSE 0 END) AS compile_rate
    FROM (SELECT *, max(turn) OVER (PARTITION BY run, iteration) AS max_turn FROM trajectories WHERE stage = 'rl')
    GROUP BY run, iteration
),
steps AS (
    SELECT run, iteration, max(step) AS step FROM train_metrics WHERE stage = 'rl' GROUP BY run, iteration
)
SELECT s.run, s.iteration, st.step, s.n_trajectories, s.n_turns,
       s.mean_reward, b.reward_lo, b.reward_hi,
       s.mean_reward - first_value(s.mean_reward) OVER (PARTITION BY s.run ORDER BY s.iteration) AS vs_first,
       s.reward_turn1, s.reward_last_turn, s.pass_rate, s.compile_rate
FROM turn_stats s
JOIN bounds b USING (run, iteration)
LEFT JOIN steps st USING (run, iteration)
ORDER BY s.run, s.iteration;
