"""What a finished student becomes and how it is run: the sample files and grids (`media`), the
settings a run records for its student (`run_settings`), the model card (`model_card`), the
`pipeline/` folder WanPipeline loads (`pipeline_folder`), and an exported student folder as the
tools load it (`student_folder`). Below the trainer and the report: it imports distill.models,
distill.data, distill.config and distill.ops.
"""
