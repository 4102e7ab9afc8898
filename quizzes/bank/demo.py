"""Demo bank for the machinery's tests (tests/fixtures/00-demo.ipynb). Not a lab.

Shows the four kinds of question a lab bank uses: a numeric answer from a formula,
a numeric answer from a measurement taken on the student's machine, a multiple
choice with an explanation per option, and a prediction (asked with ``quizzes.predict``
in the cell before the measurement, marked against it).
"""

from quizzes.questions import Choice, Numeric, Option

TITLE = "Demo quiz"


def _fp16_weight_gb() -> float:
    # A lab bank would call minillm.calc here (imported inside the function).
    params = 13e9
    return params * 2 / 1e9


QUESTIONS = [
    Numeric(
        "q1",
        "How many GB do the weights of a 13B-parameter model take in fp16?",
        answer=_fp16_weight_gb,
        unit="GB",
        rtol=0.02,
        explanation="fp16 stores each parameter in 2 bytes: 13e9 × 2 B = 26e9 B = 26 GB.",
    ),
    Numeric(
        "q2",
        "At the bandwidth you measured, what batch-1 decode speed (tok/s) is the ceiling "
        "for a model whose weights are 0.27 GB?",
        answer=lambda m: m["bandwidth_GBps"] / 0.27,
        unit="tok/s",
        rtol=0.05,
        needs=("bandwidth_GBps",),
        example_measured={"bandwidth_GBps": 27.0},
        explanation="Each token reads every weight once: tok/s ≤ bandwidth ÷ weight bytes.",
    ),
    Choice(
        "q3",
        "Why is batch-1 decode memory-bound?",
        options=[
            Option(
                "Each weight byte read is used for about one FLOP",
                correct=True,
                why="A matrix-vector product does ~2 FLOPs per 2-byte weight, far below the ridge point.",
            ),
            Option("The GPU has too few cores", why="Cores sit idle waiting for weights; adding more would not help."),
            Option("Python is slow", why="Interpreter overhead is real but small next to reading every weight per token."),
        ],
        explanation="Arithmetic intensity ≈ 1 FLOP/byte, while the hardware ridge is ~150-300 FLOP/byte.",
    ),
    Numeric(
        "q4",
        "Predict, from the copy bandwidth you measured above, how long one copy of a buffer of 2²³ "
        "float32 values (32 MiB read and 32 MiB written) takes. The next cell measures it; your "
        "prediction is right within 20%.",
        answer=lambda m: m["copy_big_ms"],
        unit="ms",
        rtol=0.2,
        needs=("copy_big_ms",),
        example_measured={"copy_big_ms": 2.5},
        predict=True,
        explanation="A copy reads and writes every byte once: time ≈ 2 × bytes ÷ bandwidth.",
    ),
]
