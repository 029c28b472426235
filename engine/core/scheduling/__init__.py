"""The scheduler's parts, one job each; `engine/core/scheduler.py` is the loop over them.

admission.py        requests on their way in: the waiting queue, grammars still compiling
step_budget.py      one step's plan: the token budget, chunking, what each request computes
slot_allocator.py   KV slots for the plan, preempting by the policy when the cache is full
in_flight.py        the batches handed out and not yet back (pipeline parallelism, async scheduling)
kv_transfer_side.py the KV connector's scheduler half: external tokens, loads, holds, invalid blocks
output_builder.py   the step's SchedulerOutput: the difference from what the workers already know
step_results.py     a returned step's tokens landed on their requests, as EngineCoreOutputs
(speculation's reservations and rewinds: engine/spec_decode/scheduling.py)
"""
