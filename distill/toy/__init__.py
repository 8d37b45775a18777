"""A synthetic world with known answers, and a small Wan 2.2 teacher trained on it.

Separate from the trainer on purpose: the trainer sees an ordinary Wan 2.2 teacher folder. Only
evaluation looks here, when the teacher folder holds `toy_world.json`.

- `world`: the prompt grammar and the hidden variation of each prompt
- `render`: draws a scene as a picture (what the teacher learned to produce)
- `score`: reads a picture back (attributes, variations), accuracy and diversity gap
- `build`: fits the VAE and trains the two experts; assembles a teacher folder from shipped weights
- `evaluation`: the toy entries of `distill.evaluate`'s report
"""
