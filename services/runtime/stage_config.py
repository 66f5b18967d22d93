"""Each stage's section of a mesh's config (services/runtime/config.py): where its replicas listen and run, and for the
engine stages the engine and the switches each of its optimisations has for an A/B."""

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Replica:
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    # Address the server listens on; empty: the host itself for loopback hosts, all interfaces otherwise.
    bind: str = ""
    device: str = "cpu"
    # Replicas with the same domain share /dev/shm (one host, one IPC namespace) and hand tensors over by reference.
    shm_domain: str = "local"
    # Output modalities whose requests this replica is preferred for (encoder and thinker routing).
    prefer_for: list[Literal["text", "audio"]] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def bind_address(self) -> str:
        bind = self.bind or (self.host if self.host in ("127.0.0.1", "localhost", "::1") else "0.0.0.0")
        return f"{bind}:{self.port}"


@dataclass
class SamplingDefaults:
    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    max_tokens: int = 512
    repetition_penalty: float = 1.0


@dataclass
class GatewayConfig:
    replicas: list[Replica] = field(default_factory=lambda: [Replica(port=50051, metrics_port=9100)])
    thinker: SamplingDefaults = field(default_factory=SamplingDefaults)
    talker: SamplingDefaults = field(
        default_factory=lambda: SamplingDefaults(temperature=0.9, top_p=1.0, top_k=50, max_tokens=4096, repetition_penalty=1.05)
    )
    # encoder and thinker routing: by the request's output modality (replicas' prefer_for) then load, by load
    # alone, or by modality alone (fixed: the preferred replica however busy, the seed system's map; #8's A/B).
    # Replicas without prefer_for are routed by load either way.
    encoder_routing: Literal["modality", "least_loaded", "fixed"] = "modality"
    thinker_routing: Literal["modality", "least_loaded", "fixed"] = "modality"
    # How often the gateway asks each replica of a stage with several for its load (every caller's work);
    # 0: it counts only its own calls in flight.
    load_poll_ms: int = 100


@dataclass
class PreprocessConfig:
    replicas: list[Replica] = field(default_factory=list)
    # Decoders per replica: worker processes (off the server's interpreter), or threads of it.
    workers: int = 2
    pool: Literal["process", "thread"] = "process"
    # Image and video patches handed on as the resized pixels' bytes, normalised by the encoder on its device
    # (uint8: a quarter of the bytes through the decoder pool, the transport and the copy to the GPU), or
    # normalised here on the CPU (float32).
    pixels: Literal["uint8", "float32"] = "uint8"
    # Audio handed on as its log-mel features, made here on the CPU (mel), or as the 16 kHz waveform, its
    # log-mel made by the encoder on its device (pcm: no spectrogram in the decoder pool).
    audio: Literal["mel", "pcm"] = "mel"
    # With worker processes: each worker puts the features it made into a shared-memory pool of its own and hands
    # back only their ref, where otherwise they come back through the pool's pipe (pickled: 1.5 MB for a 512x512
    # image) and this replica's own process copies them into its pool. That process used 1.4-1.5 cores at 32
    # image or audio requests (stage_cpu_frac in bench/results/2xh200-mesh-default-acc04a2.json), and i2t's
    # preprocess call took 127 ms at the gateway against 66 in the stage at p50. The workers' pools are not in
    # the replica's slot gauges. Off until measured (the mesh variant put-in-workers).
    put_in_workers: bool = False


@dataclass
class EngineStageConfig:
    """A stage whose engine runs on a thread of its own beside the server's (encoder, thinker, talker)."""
    replicas: list[Replica] = field(default_factory=list)
    # How long the engine's thread may wait for the interpreter lock while the server's thread holds it (Python's
    # switch interval: its default, 5 ms, is paid after each of the engine's device waits while the server is busy).
    switch_interval_ms: float = 0.5


@dataclass
class EncoderConfig(EngineStageConfig):
    engine: Literal["reference"] = "reference"
    # Encode every item a step holds in one call per tower (off: one call per item).
    batch: bool = False
    # The towers' attention: varlen, every item of a call in one SDPA call per layer with no wait on the device
    # (services/encoder/attention.py); sdpa, transformers' own, one call per item after a wait in every layer.
    attention: Literal["varlen", "sdpa"] = "varlen"
    # The towers compiled (inductor, shapes dynamic: their layers' small kernels fused), warmed up at start on
    # an image of 512x512 and a 7 s clip. Off until measured.
    compile: bool = False
    # On a GPU, with varlen attention: the vision tower replayed from a CUDA graph per list of grids (images of
    # one size, a step's n of them), captured at start for one 512x512 image and for any other list once it
    # recurs (the step that captures waits for it), at most 16: eager, the host launches its 27 layers' kernels one
    # by one (one image took 28.7 ms to encode at concurrency 1 in bench/results/2xh200-mesh-default-acc04a2.json).
    # Off here (a CPU has none); the GPU configs turn it on (configs/2xh200.yaml says why; the mesh variant
    # encoder-eager measures it off).
    graphs: bool = False


@dataclass
class LMStageConfig(EngineStageConfig):
    """A stage running a language model (the thinker, the talker)."""
    # reference: transformers' modules, one request per forward; native: paged KV and continuous batching.
    engine: Literal["reference", "native"] = "reference"
    # native engine: KV cache blocks of block_size tokens (0 blocks: as many as the device has room for),
    # at most max_batched_tokens tokens and max_seqs sequences per step; experts by loop, grouped GEMM, or
    # triton: Triton kernels for decode-sized steps and the grouped GEMM for longer ones (GPU only);
    # triton_sorted: Triton kernels for longer steps too, their rows grouped by expert first (not yet measured).
    block_size: int = 16
    kv_blocks: int = 0
    max_batched_tokens: int = 2048
    max_seqs: int = 256
    moe: Literal["loop", "grouped", "triton", "triton_sorted"] = "loop"
    # Experts in fp8 (e4m3), scaled per output channel or per 128 x 128 tile (from a block-fp8 checkpoint: its
    # own tiles and values); off: the model's dtype (a block-fp8 checkpoint is then dequantised at load).
    fp8_experts: Literal["off", "channel", "block"] = "off"
    # With fp8 experts: decode steps' expert inputs in e4m3 too (per token and 128 channels, quantised once per
    # projection), multiplied on fp8 tensor cores; off: bf16 inputs, the weights converted as they load.
    fp8_activations: bool = False
    # With fp8 activations: the down projection's input quantised by the gate/up kernel as it stores it, where its
    # N tiles are 128 wide (17 to 64 tokens a step), not by a kernel of its own: one kernel less a layer, the same
    # output (tests/test_triton_moe.py). Measured, it is within the runs' spread: 3,076 against 3,059 tok/s at 32
    # (bench/results/thinker-1xh200-fp8a8*-b32-f53beb6.json), so it stays off.
    fp8_fused_quant: bool = False
    # Attention kernels: flashinfer (GPU, 16-bit), PyTorch's SDPA (anywhere), or auto: flashinfer where it can run.
    attention: Literal["auto", "torch", "flashinfer"] = "auto"
    # Decode steps of up to this many sequences replay CUDA graphs (flashinfer attention, grouped or triton
    # experts); 0: every step runs eagerly.
    cuda_graph_max_batch: int = 0
    # Captured decode attention through flashinfer's tensor-core kernels (its prefill kernels, split over the KV and
    # merged); off: its CUDA-core decode kernel. On by default: 229 against 206 tok/s at 1 request, 1,938 against
    # 1,843 at 32 (bench/results/thinker-1xh200-decode-tensor-cores-*-2434a01.json).
    decode_tensor_cores: bool = True
    # Captured decode attention on the tensor-core kernels splits each sequence's keys over several CTAs and merges
    # them (flashinfer's way in a graph) for batches of up to this many sequences; larger batches give each
    # sequence and KV head one CTA and no merge. -1: every batch splits. Not yet measured.
    decode_split_kv_max_batch: int = -1
    # Captured decode attention planned without flashinfer's wrapper after its first plan (flashinfer 0.6.13, its
    # tensor-core kernels; other kernels plan through the wrapper): the page table sent by one copy and the kernel
    # module's plan called directly, the wrapper's checks, conversions and three copies skipped. The thinker's is on
    # (ThinkerConfig); the talker's is off until measured.
    decode_direct_plan: bool = False
    # A direct plan whose schedule would be the last one's is not run (services.llm.decode_plan.KeptPlan):
    # flashinfer's scheduler reads only each row's page count. 10 plans in 259 steps at 32 requests took 50-190 us a
    # step off the host (bench/results/README.md, "Session 22"); on a GPU flashinfer's own plan wrote every kept
    # schedule again, entry for entry (tests/test_gpu_attention.py, session 23). On for the thinker (ThinkerConfig);
    # the talker's is off until measured.
    decode_keep_plans: bool = False
    # The engine's waits on the device poll it rather than sleep in the driver (services.llm.host.wait), its thread
    # keeping a core busy and the interpreter lock between polls. Off: polled or asleep, neither engine's step at 32
    # requests was faster in session 21's A/B (bench/results/README.md, "Session 21").
    spin_wait: bool = False
    # Steps no decode graph holds (prompt chunks, prompts beside decode tokens, the thinker's multimodal rows) of
    # up to this many tokens replay CUDA graphs between their attentions, recorded per token count of a ladder
    # (services/llm/pieces.py: flashinfer attention, grouped or triton experts); on the CPU the same pieces run
    # eagerly. 0: such steps launch every kernel eagerly. Off until measured.
    step_graphs: int = 0
    # Compile the layers' elementwise work (norms, rotary, routing, experts glue) into fused kernels.
    compile: bool = False

    @property
    def native_args(self) -> dict:
        return dict(block_size=self.block_size, kv_blocks=self.kv_blocks, max_batched_tokens=self.max_batched_tokens,
                    max_seqs=self.max_seqs, moe=self.moe, fp8_experts=self.fp8_experts,
                    fp8_activations=self.fp8_activations, fp8_fused_quant=self.fp8_fused_quant, attention=self.attention,
                    cuda_graph_max_batch=self.cuda_graph_max_batch, decode_tensor_cores=self.decode_tensor_cores,
                    decode_split_kv_max_batch=self.decode_split_kv_max_batch,
                    decode_direct_plan=self.decode_direct_plan and self.decode_tensor_cores,
                    decode_keep_plans=self.decode_keep_plans, spin_wait=self.spin_wait, step_graphs=self.step_graphs, compile=self.compile)


@dataclass
class ThinkerConfig(LMStageConfig):
    # Decode steps overlapped with the host: a step is launched before the previous one's tokens are read, so
    # the host's work for a step (scheduling, planning, launching) runs while the device computes the one
    # before. A token then reaches its request one step later, and a sequence that stops on EOS computes one
    # step more, discarded. Steps with repetition penalties or minimum lengths never overlap.
    overlap: bool = False
    # Captured decode steps draw their tokens inside the graph (temperature, top-p, top-k below 64, seeded
    # noise: what the sampler gives, without its thirty-odd launches a step); rows with a repetition penalty,
    # a minimum length or a wider top-k draw after the graph. Off: every step draws after it.
    graph_sampling: bool = True
    # Overlapped decode steps copy their speech requests' states (input embedding, accept layer: 8 KB a token)
    # to host memory beside their tokens, so they go to the talker inside the message, not as one CUDA IPC
    # transfer per request and token (a put here, a read there: host time on both sides at every token).
    host_states: bool = True
    # On for the thinker (LMStageConfig): its host step at 32 requests took 1.01 ms against 1.63 through flashinfer's
    # wrapper on one machine, 1.11 and 1.29 against 2.26 on another (bench/results/README.md, "Session 20").
    decode_direct_plan: bool = True
    decode_keep_plans: bool = True
    # Decode graphs load their inputs from pinned host memory and write their draws back to it themselves, and take
    # the pending step's tokens from the last graph's draws on the device (services/thinker/decode.py): a steady
    # step is the graph's launch and an event, with no copies, events or kernels of its own. The host's step at 32
    # requests in bf16: 0.55 and 0.61 ms against 1.49 with its copies (bench/results/README.md, "Session 23").
    decode_mapped_io: bool = True
    # A request that gives no seed gets a random one of its own when it arrives, so every draw it makes comes from
    # hashed noise, and the decode graphs hold no generator: torch queues two kernels before each replay of a graph
    # that draws from its generator (its seed and offset filled in). Off until measured on a GPU.
    decode_hashed_noise: bool = False
    # Each decode graph captured this many times and replayed in turn (services/llm/graphs.py): the bare graph at 32
    # requests relaunched in a steady loop took 0.24 ms a launch in one run (bench/results/README.md, "Session 24"),
    # where one launch behind a running replay took 0.03. Whether other executables launch faster is not measured
    # (the slow launches of later bench cells have a likelier cause, the bench's profiler): 1 (one copy) until it is.
    decode_graph_copies: int = 1
    # Steps of up to 64 rows (decode) project attention's output through a Triton kernel split over the reduction
    # (services/llm/triton_linear.py; the shapes in its TILES), its partial sums added by the compiled code after it:
    # 7.5 us a layer at 32 rows against cuBLAS's 9.8 (a split-K GEMM and its reduction). The thinker in bf16 at 32
    # requests: 2,010 tok/s (15.90 ms a step on the GPU) against 2,006 (16.03) without it, one process each on one
    # machine (bench/results/thinker-1xh200-bf16-b32-linear-{on,off}-c38f8f3.json).
    triton_linear: bool = True

    @property
    def native_args(self) -> dict:
        return {**super().native_args, "overlap": self.overlap, "graph_sampling": self.graph_sampling,
                "host_states": self.host_states, "decode_mapped_io": self.decode_mapped_io,
                "decode_hashed_noise": self.decode_hashed_noise, "decode_graph_copies": self.decode_graph_copies,
                "triton_linear": self.triton_linear}


@dataclass
class TalkerConfig(LMStageConfig):
    # Streaming code2wav: a small first chunk for a low time to first audio, then chunks with left context:
    # chunk_frames each (chunk_growth 0), or each chunk_growth times the one before up to chunk_frames, so a
    # smaller first chunk need not leave a listener waiting for the next (each takes less time to make than
    # the audio before it lasts). By default 2, 4, 8, 16, then 25 frames: the first audio leaves after two
    # frames (160 ms of speech) instead of five, some 30 ms sooner at one request on an H200 (a frame step
    # took 9 ms there, bench/results/smoke-2xh200-gpu1-fix.json).
    first_chunk_frames: int = 2
    chunk_frames: int = 25
    left_context_frames: int = 25
    chunk_growth: float = 2.0
    # native engine with cuda_graph_max_batch: code2wav replayed from CUDA graphs for each chunk shape.
    code2wav_graphs: bool = True
    # native engine on a GPU: code2wav on a stream of its own, beside the frame loop, read back when it is done.
    code2wav_stream: bool = True
    # code2wav's precision, either engine: the model's, or its own (`bench.stages --stages code2wav` measures
    # each precision's waveforms against float32's, and its speed).
    code2wav_dtype: Literal["model", "float32", "bfloat16", "float16"] = "model"
    # Either engine: code2wav's SnakeBeta activations each one compiled kernel (inductor, shapes dynamic: one
    # compile), where eager each is five passes over the signal: code2wav at 32 rows 3-4% faster, at 1 row 11-17%
    # (bench/results/code2wav-1xh200-fuse-a7aa69a.json). Off: at 32 requests the talker's frames/s did not move
    # past its run-to-run spread (talker-1xh200-b32-*-a7aa69a.json, configs/2xh200.yaml's talker comment).
    code2wav_fuse: bool = False
    # Either engine: code2wav's decoder run channels-last, the bias, residual and SnakeBeta between two of its
    # convolutions in one pass, dilated convolutions folded, each chunk decoded from where the samples after its
    # left context need it (119 of 200 rows; services/talker/code2wav.py). On an H200, 32 rows of 50 frames in
    # 20.7 ms against transformers' 115.6 in bf16, nearer float32 (42.0 dB against 40.8), and the talker at 32
    # requests 3,190-4,094 frames/s against 2,464-2,514 in the same calls
    # (bench/results/{code2wav-1xh200-native,talker-1xh200-b32-*}-53de46d.json). Off here because it needs a GPU
    # for its Triton pass; on in the GPU configs.
    code2wav_native: bool = False
    # native engine on a GPU: the frame loop on a high-priority stream, code2wav's at the default low priority.
    # No gain measured: 2,514 frames/s at 32 requests against 2,464-2,824 without, and with code2wav native
    # 3,170 against 3,190-4,094 (bench/results/talker-1xh200-b32-*-53de46d.json): off.
    frames_first: bool = False
    # native engine: a frame step is launched before the previous one's codes are read (the repetition penalty
    # kept on the device), so the host's work for a step runs while the device computes the one before. A
    # frame reaches its request one step later; a request that ends on the end code computes one frame more,
    # discarded. On by default: 19% more frames/s at 32 and 64 requests on an H200
    # (bench/results/talker-1xh200-native-modes.json).
    overlap: bool = True
    # Captured frame steps draw their first codes inside the graph (repetition penalty, suppressed codes, the end
    # code, top-k below 64, seeded noise: what the sampler gives, without its fifty-odd launches a frame); rows
    # with stop ids banned for a minimum length or a wider top-k draw after it. On by default: 134 against 94
    # frames/s at 1 request, 2,544 against 2,176 at 32 (64 frames each, overlapped steps, one H200;
    # bench/results/ab-2xh200-ecdda12.txt).
    graph_sampling: bool = True

    @property
    def native_args(self) -> dict:
        return {**super().native_args, "code2wav_graphs": self.code2wav_graphs, "code2wav_stream": self.code2wav_stream,
                "overlap": self.overlap, "graph_sampling": self.graph_sampling, "frames_first": self.frames_first}
