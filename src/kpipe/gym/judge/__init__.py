"""The judge: one evaluation as the protocol's steps (``evaluation.evaluate``), the static screen
(``screen``), the comparison of outputs (``compare``), the result (``result``) and its feedback
(``feedback``). It runs in the evaluating process, never candidate code; the verdict and the reward
come only from what it observes itself.
"""
