"""Task sources (code, math, table QA), the Task they yield, and the weighted, curriculum-aware mixer."""
from producers.tasks.arithmetic import DigitAdditionSource, ReasoningGymSource
from producers.tasks.humaneval import HumanEvalSource
from producers.tasks.mixer import Curriculum, TaskMixer, TasksExhausted
from producers.tasks.sources import SOURCES, load_source
from producers.tasks.table_qa import TableQASource
from producers.tasks.task import Task, TaskSource

__all__ = [
    "SOURCES", "Curriculum", "DigitAdditionSource", "HumanEvalSource", "ReasoningGymSource", "TableQASource",
    "Task", "TaskMixer", "TaskSource", "TasksExhausted", "load_source",
]
