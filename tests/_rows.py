"""Six generic-schema multiple-choice rows (answers given as text, index and letter) that the CLI
tests write to a local ``.jsonl`` file."""

ROWS = [
    {"question": "Capital of France?", "options": ["Paris", "Rome", "Oslo"], "answer": "Paris"},
    {"question": "2 + 3 = ?", "options": ["4", "5"], "answer": 1},
    {"question": "Largest planet?", "options": ["Mars", "Venus", "Jupiter", "Earth"], "answer": "C"},
    {"question": "Colour of the sky?", "options": ["blue", "green"], "answer": 0},
    {"question": "Plants absorb?", "options": ["oxygen", "carbon dioxide", "helium"], "answer": 1},
    {"question": "Opposite of hot?", "options": ["cold", "warm"], "answer": 0},
]
