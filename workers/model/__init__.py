"""The models a job trains: their modules and their parameter/FLOP formulas."""
