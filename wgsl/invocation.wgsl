// Prelude of every kernel but the matrix products, compiled after the f16 pair prelude: the
// builtins an entry point takes (`Invocation`) over a dispatch of (x, y) workgroups of WG
// invocations, y > 1 where x alone would pass the device's 65535 limit, and the element an
// element-wise kernel's invocation handles. The kernel file (or, for attention, the decode
// prelude) declares WG.

struct Invocation {
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
}

// The workgroup's index in the dispatch, x fastest.
fn workgroup_index(inv: Invocation) -> u32 {
    return inv.wid.x + inv.wid.y * inv.nwg.x;
}

// The element this invocation handles, in a kernel of one element per invocation.
fn flat_index(inv: Invocation) -> u32 {
    return workgroup_index(inv) * WG + inv.lid;
}
