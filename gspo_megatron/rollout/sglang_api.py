"""The part of SGLang's HTTP API this project uses, declared once.

`SGLANG_VERSION` is the server version the engine is written against (the `sglang` extra in
pyproject.toml pins the same). `ENDPOINTS` lists every route the engine and the weight sync call,
with the HTTP method, the request class in `sglang/srt/managers/io_struct.py` whose fields the JSON
body is decoded into, and the fields we send. `payload(route, **fields)` builds a body and refuses
a field not declared here, so the engine cannot drift from this table; tests/test_sglang_contract.py
checks the table against SGLang's own source (routes in `srt/entrypoints/http_server.py`, request
classes in `srt/managers/io_struct.py`), and tests/sglang_double.py, the HTTP test double, refuses
whatever is not in it.

Facts from sglang 0.5.23's source that shape the client (file:line in that wheel):
  * update_weights_from_distributed / update_weights_from_tensor succeed only inside a weight-update
    session: POST /begin_weight_update ... POST /end_weight_update (http_server.py:1458-1485;
    the scheduler's weight updater answers success=False outside one). Disk updates need none.
  * the served weight version is in GET /model_info ("weight_version", http_server.py:812-826);
    there is no /get_weight_version, and /get_server_info is deprecated in favour of /server_info.
  * routed experts (``return_routed_experts: true`` on /generate) come back only from a server
    launched with ``--enable-return-routed-experts`` (ROUTED_EXPERTS_FLAG; exec_.py:158): without
    it the capturer is None (state_capturer/routed_experts.py `create`) and the response simply
    lacks the field. ``meta_info["routed_experts"]`` is standard base64 of the raw bytes of an
    int32 array [seqlen - 1 - start_len, num_hidden_layers, num_experts_per_tok] (C order) for
    positions start_len .. seqlen - 2, seqlen = prompt + output tokens (state_capturer/base.py
    get_topk, detokenizer_manager.py `_b64_encode_per_request`); SGLangEngine decodes it.
  * request bodies are decoded into io_struct classes (msgspec structs deriving BaseReq, and the
    GenerateReqInput dataclass); a misspelt field is at best silently ignored, so the client only
    sends fields declared here and the double refuses any other.
"""
from __future__ import annotations

from dataclasses import dataclass

SGLANG_VERSION = "0.5.23"


@dataclass(frozen=True)
class Endpoint:
    method: str  # the method we use (the route may accept others)
    route: str
    request_class: str | None  # io_struct class of the JSON body; None: no body is read
    fields: frozenset[str]  # the fields we may send


def _ep(method: str, route: str, request_class: str | None, *fields: str) -> Endpoint:
    return Endpoint(method, route, request_class, frozenset(fields))


ENDPOINTS: dict[str, Endpoint] = {e.route: e for e in (
    _ep("GET", "/health_generate", None),
    _ep("GET", "/model_info", None),
    _ep("GET", "/server_info", None),
    # return_routed_experts / routed_experts_start_len: io_struct.py:264-268 (the api/v1 contract
    # gate's GenerateRequest lacks return_routed_experts but ignores unknown keys, api_types.py:237)
    # logprob_start_len (io_struct.py:233): 0 asks for every prompt token's log-prob, the refit probe
    _ep("POST", "/generate", "GenerateReqInput", "input_ids", "sampling_params", "return_logprob", "rid",
        "return_routed_experts", "routed_experts_start_len", "logprob_start_len"),
    _ep("POST", "/abort_request", "AbortReq", "abort_all"),
    # a push that does not wait for the generation in flight: retract-pause, update, continue
    # (io_struct.py PauseGenerationReqInput.mode, ContinueGenerationReqInput.torch_empty_cache)
    _ep("POST", "/pause_generation", "PauseGenerationReqInput", "mode"),
    _ep("POST", "/continue_generation", "ContinueGenerationReqInput", "torch_empty_cache"),
    _ep("POST", "/flush_cache", None),
    _ep("POST", "/update_weights_from_disk", "UpdateWeightFromDiskReqInput",
        "model_path", "load_format", "weight_version", "flush_cache"),
    _ep("POST", "/begin_weight_update", "BeginWeightUpdateReqInput"),
    _ep("POST", "/end_weight_update", "EndWeightUpdateReqInput"),
    _ep("POST", "/init_weights_update_group", "InitWeightsUpdateGroupReqInput",
        "master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"),
    _ep("POST", "/update_weights_from_distributed", "UpdateWeightsFromDistributedReqInput",
        "names", "dtypes", "shapes", "group_name", "flush_cache", "weight_version"),
    _ep("POST", "/destroy_weights_update_group", "DestroyWeightsUpdateGroupReqInput", "group_name"),
    _ep("POST", "/update_weights_from_tensor", "UpdateWeightsFromTensorReqInput",
        "serialized_named_tensors", "load_format", "flush_cache", "weight_version"),
    _ep("POST", "/release_memory_occupation", "ReleaseMemoryOccupationReqInput", "tags"),
    _ep("POST", "/resume_memory_occupation", "ResumeMemoryOccupationReqInput", "tags"),
)}

# The server flag without which /generate never returns routed experts (a store_true flag from the
# ServerArgs field enable_return_routed_experts, arg_groups/fields/exec_.py:158, also reported by
# GET /server_info under that name).
ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"
ROUTED_EXPERTS_SERVER_ARG = "enable_return_routed_experts"
# a JSON object of HF config keys the server applies over config.json (arg_groups/fields/model.py;
# ModelFamily.engine_config_overrides)
MODEL_OVERRIDE_FLAG = "--json-model-override-args"
MODEL_OVERRIDE_SERVER_ARG = "json_model_override_args"

# Routes of the sglang-router (a separate package), used only to find a router's workers.
ROUTER_ROUTES = ("/list_workers", "/workers")

# Weight pushes that must run inside a weight-update session.
SESSION_ROUTES = frozenset({"/update_weights_from_distributed", "/update_weights_from_tensor"})


def payload(route: str, **fields) -> dict:
    """The JSON body for `route`; a field this table does not declare is a programming error."""
    ep = ENDPOINTS.get(route)
    if ep is None:
        raise KeyError(f"{route}: not an SGLang endpoint this project declares (rollout/sglang_api.py)")
    unknown = sorted(set(fields) - ep.fields)
    if unknown:
        raise KeyError(f"{route}: fields {unknown} are not declared for {ep.request_class} (rollout/sglang_api.py)")
    return dict(fields)


def version_matches(got) -> tuple[bool, str | None]:
    """A server's /server_info "version" against SGLANG_VERSION, by release: builds of a release
    for a CUDA version carry a local label (``0.5.23+cu129``) and speak that release's API.
    (ok, note about a local label or None); rollout/http_servers.py release_check."""
    from .http_servers import release_check

    return release_check(got, SGLANG_VERSION)
