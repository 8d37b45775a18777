"""The models and the maths to run them, with no notion of a training run: the Wan 2.2 teacher
(loading, placement, routing by timestep, guidance: `teacher`; which Wan 2.2 model a folder
holds, read from its files: `teacher_kind`; how a condition such as the I2V image enters a forward:
`conditioning`), the student (its config checked
against the teacher: `student_config`; building, initialising, exporting: `student`), the
flow-matching maths every method shares (`flow_matching`), the few-step scheduler and rollout
(`few_step`), diffusers pipelines, text encoding and VAE decoding (`pipelines`), the original Wan
layout (`original/`), the tiny random teacher (`tiny`), and the folder checks they share
(`layout`, `config_types`). Imports distill.ops and distill.config only.
"""
