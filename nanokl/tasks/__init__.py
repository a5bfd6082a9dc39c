"""STUB (helper B replaces): the task table."""
from nanokl.tasks import arith, gsm8k

TASKS = {"arith": arith, "gsm8k": gsm8k}
