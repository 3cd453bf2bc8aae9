"""The document and questions shared by rag_run_batch.py and rag_openai_client.py (not an example itself)."""

DOCUMENT = """The Lumen Valley Observatory was founded in 1962 by the astronomer Clara Whitfield. It sits on
Mount Arden, 2,340 meters above sea level, about 80 kilometers north of the town of Brenholm. Its largest
instrument is the Whitfield Telescope, a reflecting telescope with a mirror 3.6 meters across, installed in
1988. The observatory is run by the University of Brenholm and employs 45 people, including 12 astronomers.
Every year about 20,000 visitors come to its public open nights, which take place on the first Saturday of
each month from April to October. In 2015 the observatory discovered a comet, later named Comet Arden, which
passes near the Sun every 74 years. The site was chosen for its dry climate: it has clear skies on about
300 nights a year."""
SYSTEM = "Answer the question using only this document.\n\n" + DOCUMENT

QUESTIONS = [  # (question, a word the right answer contains)
    ("Who founded the observatory?", "Whitfield"),
    ("In which year was the observatory founded?", "1962"),
    ("On which mountain is the observatory?", "Arden"),
    ("How wide is the mirror of the Whitfield Telescope?", "3.6"),
    ("Which university runs the observatory?", "Brenholm"),
    ("How many people work at the observatory?", "45"),
    ("When are the public open nights held?", "Saturday"),
    ("What did the observatory discover in 2015?", "comet"),
]
