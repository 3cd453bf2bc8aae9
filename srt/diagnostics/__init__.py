"""Opt-in diagnostics: instruments a run can switch on (srt/env.py), never imported by the hot path otherwise."""
