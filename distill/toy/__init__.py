"""A synthetic world with known answers, and a small Wan 2.2 teacher trained on it.

Separate from the trainer on purpose: the trainer sees an ordinary Wan 2.2 teacher folder. Only
evaluation looks here, when the teacher folder holds `toy_world.json`.

- `world`: the prompt grammar and the hidden variation of each prompt
- `render`: draws a scene as a picture (what the teacher learned to produce)
- `score`: reads a picture back (attributes, variations), accuracy and diversity gap
- `build`: trains the two experts (`recipe`: its settings; `vae_fit`: the VAE first; `text_padding`:
  short prompts at the cost of long ones; `grow`: deeper, wider experts from trained ones)
- `shipped`: the shipped teacher copied out as a teacher folder (seconds), staged folder writes
- `evaluation`: samples teacher and student on the world's prompts and scores them (the report's
  toy entry is written by distill.report.toy_report)
- `stage_one`: the command that retrains the shipped stage-1 student (`make toy-stage1`)
- image to video: `build_i2v` grows the I2V teacher, `image_score` scores clips against their input
  image, `i2v_evaluation` samples it, `i2v_data` writes training pairs; the commands `i2v_students`
  (scores few-step students against the teacher) and `i2v_ship` (retrains the shipped ones)
- streams longer than the clips: `stream_score` scores them, `stream_reader` decodes them,
  `window_judge` asks a teacher about windows of them, `window_teacher` trains one that knows them

It may import distill.ops and distill.models only; distill.report reads it, the trainer never does.
"""
