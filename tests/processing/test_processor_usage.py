"""The processor and tokenizer as users call them (issue 20 findings 1, 6, 7, 8; issue 17's processor options;
issue 19's chat-message checks), each test written as the user's command."""

import io
import json
import random
import shutil

import jinja2
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer, pipeline

import modeling_deepseek_v41  # noqa: F401  registers the model with the Auto classes
from processing import DEFAULT_CHAT_TEMPLATE, DeepseekV41ImageProcessor, DeepseekV41Processor, span_length
from repo_paths import DEFAULT_CHECKPOINT, FIXTURES

DEFAULT = DEFAULT_CHECKPOINT
TINY = FIXTURES / "tiny-vision" / "checkpoint"
BOS = "<｜begin▁of▁sentence｜>"
PLACEHOLDER = "<｜deepseek_image｜>"


def picture(colour=(200, 30, 30), size=(64, 48)) -> Image.Image:
    return Image.new("RGB", size, colour)


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def chat(question: str, image=None) -> list[dict]:
    content = [{"type": "text", "text": question}] if image is None else [{"type": "image", "image": image},
                                                                          {"type": "text", "text": question}]
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def processor() -> DeepseekV41Processor:
    return AutoProcessor.from_pretrained(TINY)


# issue 20, finding 1: batched processor output is left-padded, and batched answers equal one-at-a-time answers


def test_batched_processor_output_is_left_padded(processor):
    texts = [f"{PLACEHOLDER} What colour?", "A much longer text prompt without any picture in it at all."]
    out = processor(text=texts, images=[picture()], padding=True, return_tensors="pt")
    mask = out["attention_mask"]
    assert mask[0, 0] == 0 and mask[0, -1] == 1 and mask[1].all()  # the short row is padded at its start
    pad = int((mask[0] == 0).sum())
    assert (out["input_ids"][0, :pad] == processor.tokenizer.pad_token_id).all()
    assert (out["token_types"][0, :pad] == -1).all()
    assert AutoTokenizer.from_pretrained(DEFAULT).padding_side == "left"


def test_batched_image_pipeline_equals_one_at_a_time():
    from training.data import QUESTIONS, qa_example, random_sample

    pipe = pipeline("image-text-to-text", model=str(DEFAULT))
    rng = random.Random(3)
    chats = [qa_example(random_sample(rng), 0)["messages"], qa_example(random_sample(rng), 1)["messages"]]
    assert len(QUESTIONS[0][0]) != len(QUESTIONS[1][0])  # rows of different lengths, so padding is exercised
    settings = dict(max_new_tokens=4, return_full_text=False, generate_kwargs={"do_sample": False})
    batched = [row[0]["generated_text"] for row in pipe(text=chats, batch_size=2, **settings)]
    single = [pipe(text=messages, **settings)[0]["generated_text"] for messages in chats]
    assert batched == single



def test_pipeline_batch_mixing_picture_and_text_only_chats_equals_one_at_a_time():
    """A picture chat and two text-only chats of different lengths in one batch: the rows share the processor's keys
    (empty image inputs without a picture) and padding counts as text, so each row answers as it does alone."""
    from training.data import qa_example, random_sample

    pipe = pipeline("image-text-to-text", model=str(DEFAULT))
    chats = [qa_example(random_sample(random.Random(5)), 0)["messages"],
             [{"role": "user", "content": [{"type": "text", "text": "What does a Python list hold?"}]}],
             [{"role": "user", "content": "Hello"}]]
    settings = dict(max_new_tokens=4, return_full_text=False, generate_kwargs={"do_sample": False})
    batched = [row[0]["generated_text"] for row in pipe(text=chats, batch_size=3, **settings)]
    single = [pipe(text=messages, **settings)[0]["generated_text"] for messages in chats]
    assert batched == single

# issue 20, finding 6: the tokenizer carries the chat template; AutoImageProcessor loads the shipped checkpoint


def test_tokenizer_applies_the_chat_template():
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT)
    assert tokenizer.chat_template == DEFAULT_CHAT_TEMPLATE
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                         tokenize=False)
    assert text == f"{BOS}<｜User｜>Hello<｜Assistant｜></think>"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("folder", [DEFAULT, TINY, FIXTURES / "tiny-text" / "checkpoint"],
                         ids=lambda folder: folder.parent.name)
def test_checkpoint_folders_carry_the_template_and_left_padding(folder):
    assert (folder / "chat_template.jinja").read_text(encoding="utf-8") == DEFAULT_CHAT_TEMPLATE
    assert json.loads((folder / "tokenizer_config.json").read_text())["padding_side"] == "left"


def test_text_generation_pipeline_takes_chat_messages():
    generator = pipeline("text-generation", model=str(DEFAULT))
    out = generator([{"role": "user", "content": "Hello"}], max_new_tokens=2, do_sample=False)
    conversation = out[0]["generated_text"]
    assert conversation[0] == {"role": "user", "content": "Hello"} and conversation[-1]["role"] == "assistant"


def test_auto_image_processor_loads_the_shipped_checkpoint():
    image_processor = AutoImageProcessor.from_pretrained(DEFAULT)
    vision = json.loads((DEFAULT / "config.json").read_text())["vision_config"]
    assert isinstance(image_processor, DeepseekV41ImageProcessor)
    assert (image_processor.max_image_tokens, image_processor.min_pixels) == (vision["max_image_tokens"],
                                                                              vision["min_pixels"])


def test_image_processor_from_a_hub_layout_without_preprocessor_config(tmp_path):
    shutil.copy(DEFAULT / "config.json", tmp_path / "config.json")
    image_processor = DeepseekV41ImageProcessor.from_pretrained(tmp_path)
    assert image_processor.to_dict() == AutoImageProcessor.from_pretrained(DEFAULT).to_dict()


# issue 20, finding 7: padding_side is honoured; a rendered chat does not get a second BOS


def test_padding_side_kwarg(processor):
    texts = ["short", "a rather longer prompt than the first one"]
    right = processor(text=texts, padding=True, padding_side="right", return_tensors="pt")["attention_mask"]
    left = processor(text=texts, padding=True, return_tensors="pt")["attention_mask"]
    assert right[0, 0] == 1 and right[0, -1] == 0
    assert left[0, 0] == 0 and left[0, -1] == 1


def test_rendered_chat_gets_one_bos(processor):
    messages = chat("What is this?", picture())
    rendered = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered.startswith(BOS)
    ids = processor(text=rendered, images=[picture()], return_tensors="pt")["input_ids"][0]
    bos_id = processor.tokenizer.bos_token_id
    assert ids[0] == bos_id and ids[1] != bos_id and int((ids == bos_id).sum()) == 1
    templated = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                              return_tensors="pt")
    assert torch.equal(ids, templated["input_ids"][0])


# issue 20, finding 8: datasets' image dicts inside chat messages


@pytest.mark.parametrize("as_path", [False, True])
def test_datasets_image_dicts_in_messages(processor, tmp_path, as_path):
    image = picture((20, 160, 90))
    if as_path:
        image.save(tmp_path / "image.png")
        stored = {"bytes": None, "path": str(tmp_path / "image.png")}
    else:
        stored = {"bytes": png_bytes(image), "path": None}
    kwargs = dict(add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
    from_dict = processor.apply_chat_template(chat("Colour?", stored), **kwargs)
    from_pil = processor.apply_chat_template(chat("Colour?", image), **kwargs)
    assert torch.equal(from_dict["input_ids"], from_pil["input_ids"])
    assert torch.equal(from_dict["pixel_values"], from_pil["pixel_values"])


def test_undecodable_datasets_image_names_it(processor):
    with pytest.raises(ValueError, match="Image 1: Could not decode the image"):
        processor(text=f"{PLACEHOLDER}{PLACEHOLDER}", images=[picture(), {"bytes": b"junk", "path": None}])


# issue 17: options through transformers' processor kwargs


def test_image_kwargs_are_honoured_and_stored(processor):
    white_square = picture((255, 255, 255), size=(56, 56))  # square: no gray padding around it
    out = processor(text=PLACEHOLDER, images=[white_square], do_normalize=False)
    assert torch.equal(out["pixel_values"].float().unique(), torch.tensor([1.0]))  # rescaled, not normalized
    out = processor(text=PLACEHOLDER, images=[white_square], images_kwargs={"rescale_factor": 1 / 510})
    assert torch.equal(out["pixel_values"].float().unique(), torch.tensor([0.0]))  # (0.5 - 0.5) / 0.5
    stored = DeepseekV41ImageProcessor(do_normalize=False, image_mean=[0.1, 0.2, 0.3])
    assert stored.do_normalize is False and tuple(stored.image_mean) == (0.1, 0.2, 0.3)
    with pytest.raises(ValueError, match="`size` does not apply"):
        processor(text=PLACEHOLDER, images=[picture()], size={"height": 224, "width": 224})


def test_duplicated_kwargs_are_refused(processor):
    with pytest.raises(ValueError, match="padding was passed two times"):
        processor(text=["a", "bb"], padding=True, text_kwargs={"padding": True})
    with pytest.raises(ValueError, match="do_normalize was passed two times"):
        processor(text=PLACEHOLDER, images=[picture()], do_normalize=False, images_kwargs={"do_normalize": True})


def test_truncation_and_max_length(processor):
    text = "one two three four five six seven eight nine ten"
    out = processor(text=text, truncation=True, max_length=4)
    assert len(out["input_ids"][0]) == 4 == len(out["token_types"][0])
    padded = processor(text=["a", text], padding="max_length", max_length=30, return_tensors="pt")
    assert padded["input_ids"].shape == (2, 30)
    # a cut inside an image span is refused, not silently misaligned
    with pytest.raises(ValueError, match="truncation"):
        processor(text=f"Look {PLACEHOLDER} here", images=[picture()], truncation=True, max_length=6)


def test_assistant_tokens_mask_for_sft(processor):
    messages = [{"role": "user", "content": [{"type": "image", "image": picture()}, {"type": "text", "text": "Hi"}]},
                {"role": "assistant", "content": "A red box."}]
    out = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                        return_tensors="pt")
    ids, mask = out["input_ids"][0], out["assistant_masks"][0].bool()
    answer = processor.tokenizer.decode(ids[mask])
    assert answer == f"A red box.{processor.tokenizer.eos_token}"
    n_llm_h, n_llm_w = out["image_grids"][0, 2:].tolist()
    assert int((out["token_types"][0] >= 0).sum()) == span_length(n_llm_h, n_llm_w)


# issue 19: chat messages are checked


@pytest.mark.parametrize("messages, match", [
    ([{"role": "user", "content": "Hi"}, {"content": "no role"}], "message 1 has no 'role'"),
    ([{"role": "user", "content": {"text": "Hi"}}], "message 0 has content of type dict"),
    ([{"role": "user", "content": [{"text": "Hi"}]}], "message 0 has content part 0 .* without a 'type'"),
    ([{"role": "user", "content": 42}], "message 0 has content of type int"),
])
def test_malformed_messages_are_clear_errors(processor, messages, match):
    with pytest.raises(ValueError, match=match):
        processor.apply_chat_template(messages, add_generation_prompt=True)
    with pytest.raises(ValueError, match=f"conversation 1, {match}"):
        processor.apply_chat_template([[{"role": "user", "content": "ok"}], messages], add_generation_prompt=True)


def test_tokenizer_template_names_the_bad_message():
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT)
    with pytest.raises(jinja2.exceptions.TemplateError, match="Chat message 1 has no role"):
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}, {"content": "x"}], tokenize=False)
