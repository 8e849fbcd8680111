"""Trainers: one loop skeleton (base.RunResult) and the ps, allreduce, hybrid and pipeline modes that plug into it."""
