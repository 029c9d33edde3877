"""The text-rendering world: prompts that ask for an image showing a word, an OpenCV renderer
and prompt sets (:mod:`.world`), and the SFT data source of rendered ground truth (:mod:`.sft`).
The reward is the ``ocr`` reward (``rewards/ocr.py``, PP-OCRv4), which reads ``metadata.text``;
``text_render_colour`` (:mod:`.rewards`) checks the ink colour the OCR reward is blind to."""
