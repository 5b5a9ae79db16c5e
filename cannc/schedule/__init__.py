"""Scheduling: the cost model of this CPU, tiling choices and the tuning cache."""
