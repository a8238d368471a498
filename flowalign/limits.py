"""Upper bounds on inputs that would otherwise spend unbounded memory or time before anything fails.

Each bound sits far above any real use, so it only ever refuses a typo or a hostile file (``data.n=1e12``,
a 20 MB prompt line, a YAML alias bomb), and it is checked before the memory is spent. The config fields
and the CLI options name the bound they break in their one-line error.
"""

from __future__ import annotations

#: sampling / rollout steps T: published schedules use 1 to ~100; every step keeps latents for training
MAX_SAMPLING_STEPS = 1000
#: samples per prompt (a group): published recipes use 2 to ~64
MAX_GROUP_SIZE = 1024
#: prompts per step and samples per batch: a batch's latents are held in memory at once
MAX_BATCH = 4096
#: tasks drawn from a benchmark generator (``data.n``, ``eval.n``, ``--n``): each is built in memory
MAX_TASKS = 1_000_000
#: seeds are non-negative and fit torch's and numpy's 64-bit generators
MAX_SEED = 2**63 - 1
#: learning rates: real ones are 1e-6 to 1e-2; a larger one blows the weights up within a step
MAX_LR = 1.0
#: characters of one prompt: text encoders read at most ~1-2k tokens (a few thousand characters)
MAX_PROMPT_CHARS = 20_000
#: bytes of a YAML config file (real ones are a few KB)
MAX_CONFIG_BYTES = 10 * 2**20
#: values of a YAML document once its aliases are expanded (a real config has a few hundred)
MAX_YAML_NODES = 100_000

# Every numeric config field and CLI option has a lower and an upper bound (tests/flowalign/test_bounds.py
# walks them all). The bounds below are the shared ones, each far above any published setting.

#: training steps and step intervals (max_steps, warmup, checkpoint / log / eval / EMA periods, windows):
#: a long real run is ~10^4 steps; a period of 10^9 steps is a typo, never a setting
MAX_TRAIN_STEPS = 10_000_000
#: a time budget in minutes: a year
MAX_MINUTES = 365 * 24 * 60.0
#: optimiser updates or passes over one batch (inner_epochs, updates_per_epoch, discriminator / critic /
#: ascent steps, corrections): the batch is split into (or repeated) that many parts in memory, and
#: updates_per_epoch=10^9 is np.array_split into 10^9 arrays; published recipes use 1 to ~20
MAX_UPDATES = 1024
#: LoRA rank: the widest layer of any supported family is 5120 (Wan 14B, FLUX's 3072); a rank above a
#: layer's width costs more memory than training the layer in full and adds nothing
MAX_LORA_RANK = 8192
#: width (channels) of a small network a trainer builds itself (e.g. AFD's discriminator): 4096 channels
#: is already a billion-weight conv stack
MAX_WIDTH = 4096
#: classifier-free / distilled guidance scales: published ones are 1 to ~15; far above, the guided
#: velocity leaves the latent range and decodes to a black image (``--guidance 1e30``)
MAX_GUIDANCE = 100.0
#: dimensionless factors of a loss (β, DPO temperatures, clip ranges, thresholds, reward weights,
#: kernel temperatures): published ones are at most ~5e3 (Diffusion-DPO's β); a factor of 10^6 times a
#: bf16 loss overflows or saturates its sigmoid / exp, so training only produces NaN
MAX_COEFFICIENT = 1e6
#: a logit-normal mean (SOAR's σ sampling): sigmoid(±20) is 0 or 1 in float32, every σ the same
MAX_LOGIT = 20.0
#: checkpoints kept on disk (each a full copy of the trained weights and optimiser state)
MAX_KEEP_CHECKPOINTS = 1000
#: copies of the trained weights a trainer keeps (references, replay groups): each is a full copy
MAX_WEIGHT_COPIES = 1024
#: samples kept in a trainer's cache (encoded latents): ~10^6 latents of a 1024² image fill a GPU host's RAM
MAX_CACHE = 1_000_000
#: seconds a wait may last (a collective, a reward call, a server deadline): a week
MAX_TIMEOUT_S = 7 * 24 * 3600.0
#: processes of one group (the sequence-parallel degree, GPUs planned): more than any cluster's world size
MAX_RANKS = 65_536
#: GPU memory of one device in GB (``plan --gpu-memory``): the largest today hold 192 GB
MAX_GPU_MEMORY_GB = 4096.0
#: layers or blocks of one model component (``num_layers`` in a config.json): published transformers have
#: at most ~100; a billion would take hours to build even on the meta device
MAX_MODEL_LAYERS = 1024
#: any other count or size in a component's config.json (widths, heads, vocabulary): the largest real
#: ones are ~262k (vocabularies)
MAX_MODEL_SIZE = 2**24
#: side in pixels of an image or a rendered scene (height, width, ``pretrain-tiny --size``): every
#: published model samples at most 2048; a 100000-pixel side is a 30 GB canvas
MAX_IMAGE_SIDE = 4096
#: frames of a video: published video models sample at most a few hundred
MAX_FRAMES = 4096
#: pixels of an input image read from a file (``--image``, a JSONL ``image``), checked from its header
#: before decoding: decoding takes 3 bytes a pixel and 12 more as float32 (13000² → 1.9 GiB); the same
#: 4096 x 4096 as the reward servers' default ``--max-image-pixels``
MAX_IMAGE_PIXELS = 4096 * 4096
#: TCP ports
MAX_PORT = 65_535
#: CPU threads of one process
MAX_THREADS = 4096
#: tokens of a text encoder's input (T5 / UMT5 read 512; Qwen's few thousand)
MAX_SEQUENCE_LENGTH = 65_536
#: side of a tiny world's rendered scenes (``pretrain-tiny --size``): every scene is held in memory on CPU
#: (n_scenes x side² x 3 bytes, x frames for clips); the shipped models use 64
MAX_TINY_SIDE = 1024
#: blocks (layers) of a transformer a command builds: published ones have at most ~100
MAX_LAYERS = 1024
#: a reward server's caps (serve-reward, serve-judge), each bounded in turn: a request body in MiB (read
#: whole, ~3 copies while parsed)
MAX_SERVER_BODY_MB = 4096.0
#: pixels of one image a server decodes: PIL itself refuses images over ~179 M pixels
MAX_SERVER_IMAGE_PIXELS = 2**28
#: pixels of all the images of one request: 12 bytes each as float32 (2^32: 48 GiB)
MAX_SERVER_REQUEST_PIXELS = 2**32
#: MiB of decoded samples all requests in progress hold together: a large host's RAM
MAX_SERVER_DECODED_MB = 2.0**20
#: requests a server serves at once (each an open socket and a thread's work)
MAX_CONNECTIONS = 65_536
#: candidates per token a judge returns (``top_logprobs``; OpenAI's API allows 20)
MAX_TOP_LOGPROBS = 1000
#: reflection rounds of a unified model's trajectory (``trainer.rounds``, ``--rounds``)
MAX_ROUNDS = 64
#: tokens of one reflection (``trainer.max_new_tokens``, ``--reflection-tokens``)
MAX_REFLECTION_TOKENS = 4096
