"""How close the student is to the teacher: the measures (`measures`), eval.json and its summary
(`summary`), the toy world's entry (`toy_report`), the pictures (`plots`), and the samples and
evaluations taken during training (`monitor`). Used by the trainer and by `python -m
distill.evaluate`; imports distill.sample, distill.toy and the layers below them, never distill.train.
"""
