"""Sharding rules, one file per op family; ``base.py`` holds the registry (``register``, ``override``).

``op_table.py`` imports every family and registers its rules. ``docs/ops.md`` lists the ops and what
each rule does with each placement.
"""
