"""Quiz banks: one module per lab, ``quizzes/bank/labNN.py``, each with ``QUESTIONS``.

See the authoring guide in ``quizzes/__init__.py``. ``demo`` is a tiny bank used by the
course machinery's own tests; it is not part of any lab.
"""
