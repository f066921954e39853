"""DeepSpeed's ``deepspeed.runtime.data_pipeline.data_routing`` (random-LTD): ds-data's objects at its paths."""
