"""What runs inside the candidate's process: the child's roles (``child``), the launch and thread
hooks (``instrument``), a trial's inputs and output digests (``trial_data``), the child's clocks and
L2 flush (``timing``), PR (``profiling``) and how an exception maps to a status (``faults``).

Nothing here imports the judge (``kpipe.gym.judge``) or serving (``kpipe.gym.serve``):
``tests/test_gym_boundary.py`` walks the imports. What the two sides share is the protocol
(``kpipe.gym.protocol``) and the exchange's file format and names (``kpipe.gym.exchange``).
"""
