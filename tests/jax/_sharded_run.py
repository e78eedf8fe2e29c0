"""Run by test_jax_sharding.py in a subprocess with 4 host devices (XLA_FLAGS must precede the jax import).

Writes an .npz with one FP8 training step (outputs, gradients, updated metas) computed four ways:
``ref`` unsharded; ``gspmd`` jit over a 2x2 (data, model) mesh with sharded params/activations;
``smap`` shard_map with explicit per-shard math (amaxes pmax-reduced by the module);
``control`` the same shard_map without a MeshResource (no pmax), which must NOT match.
"""
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import fp8engine.jax as fj
from fp8engine.recipe import DelayedScaling

RECIPE = DelayedScaling(amax_history_len=4)
MR = fj.MeshResource("data", "model")
B, H, F = 16, 32, 64


def make_step(model):
    def step(params, metas, x, dy):
        def loss(params, metas, x):
            y = model.apply({"params": params, fj.FP8_COLLECTION: metas}, x)
            return jnp.sum(y * dy), y

        (_, y), (dp, dm, dx) = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(params, metas, x)
        return y, dp, dx, fj.update_fp8_metas(dm)

    return step


def flat(prefix, tree, out):
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out[prefix + jax.tree_util.keystr(path)] = np.asarray(leaf)


def data(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, H)).astype(np.float32)
    x[B // 2 :] *= 4.0  # the global amax lives in the second data shard
    dy = (rng.standard_normal((B, H if seed == 0 else F)) * 1e-2).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(dy)


def calibrated(model, x, dy):
    """Variables (boxed, with partition metadata) whose metas went through one step + update."""
    with fj.fp8_autocast(enabled=True, fp8_recipe=RECIPE, mesh_resource=MR):
        variables = model.init(jax.random.PRNGKey(0), x)
        *_, metas = jax.jit(make_step(model))(nn.unbox(variables["params"]), variables[fj.FP8_COLLECTION], x, dy)
    return variables, metas


def gspmd(mesh, out):
    model = fj.LayerNormMLP(intermediate_dim=F)  # fc1 column-parallel, fc2 row-parallel over "model"
    x, dy = data(0)
    variables, metas = calibrated(model, x, dy)
    params = nn.unbox(variables["params"])
    specs = nn.get_partition_spec(variables)["params"]
    out["gspmd_fc1_kernel_spec"] = np.array(str(specs["fc1"]["dense"]["kernel"]))
    step = jax.jit(make_step(model))
    with fj.fp8_autocast(enabled=True, fp8_recipe=RECIPE, mesh_resource=MR):
        flat("ref_mlp", step(params, metas, x, dy), out)
        place = lambda t, s: jax.device_put(t, NamedSharding(mesh, s))  # noqa: E731
        sharded = jax.tree_util.tree_map(place, params, specs, is_leaf=lambda s: isinstance(s, P))
        flat("gspmd_mlp", step(sharded, metas, place(x, P("data", None)), place(dy, P("data", None))), out)


def shard_mapped(mesh, out):
    model = fj.DenseGeneral(F, kernel_axes=(None, "tp"), bias_axes=("tp",))  # column-parallel
    x, dy = data(1)
    variables, metas = calibrated(model, x, dy)
    params = nn.unbox(variables["params"])
    step = make_step(model)
    local_step = make_step(fj.DenseGeneral(F // 2))  # per-shard module: features of one "model" shard

    def local(params, metas, x, dy):
        y, dp, dx, new_metas = local_step(params, metas, x, dy)
        # Model math does no communication: the caller reduces the replicated inputs' gradients.
        return y, jax.lax.psum(dp, "data"), jax.lax.psum(dx, "model"), new_metas

    pspec = {"kernel": P(None, "model"), "bias": P("model")}
    run = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(pspec, P(), P("data", None), P("data", "model")),
            out_specs=(P("data", "model"), pspec, P("data", None), P()),
            check_vma=False,
        )
    )
    with fj.fp8_autocast(enabled=True, fp8_recipe=RECIPE, mesh_resource=MR):
        flat("ref_dense", jax.jit(step)(params, metas, x, dy), out)
        flat("smap_dense", run(params, metas, x, dy), out)
    with fj.fp8_autocast(enabled=True, fp8_recipe=RECIPE):  # no MeshResource: amaxes stay per shard
        flat("control_dense", run(params, metas, x, dy), out)  # same jitted callable, re-traced


def main(path):
    assert len(jax.devices()) == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    out = {}
    gspmd(mesh, out)
    shard_mapped(mesh, out)
    np.savez(path, **out)


if __name__ == "__main__":
    main(sys.argv[1])
