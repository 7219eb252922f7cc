"""What orders a step's tasks, and what a step's timing says.

    schedules.py     Schedule: the clock × stage table of F/B/A tasks (gpipe, 1f1b,
                     eager-1f1b), validate(), render(), simulate(), in-flight bounds.
    instructions.py  one stage's instruction list (run / send / recv) from a schedule.
    task_timing.py   when a task's inputs were ready and when it ran; stalls named.
    timeline.py      measured task records, the per-stage Gantt chart, trace events.

May import: ``rhino.runtime.failures`` and ``rhino.runtime.threads`` (the base modules),
``rhino.errors`` and ``rhino.hlo_passes``; nothing of the other runtime subpackages. Pure:
no devices, no Ray.
"""
