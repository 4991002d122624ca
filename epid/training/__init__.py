"""The training engine: launch, ranks, the loop and everything a long run needs.

Start reading at ``loop`` (``launch``, the ``Trainer``'s epoch and step). Around it: ``preflight``
(checks before any rank starts), ``distributed`` (launch modes, process groups, signals),
``rank_data`` and ``validation`` (one rank's data and validation), ``optimizer``, ``schedule``,
``precision`` (fp32 or bf16 on the CPU, timed), ``side_by_side`` (both models on their own CPU
threads), ``passes`` and ``run_state`` (a pass's stop rules, the state a checkpoint resumes) and
``report`` / ``progress`` / ``metrics_log`` / ``tensorboard_log`` (what a run prints and writes).
"""
