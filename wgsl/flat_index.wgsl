// Prelude of the element-wise kernels (one element per invocation), compiled after the f16
// pair prelude: a dispatch of (x, y) workgroups of WG invocations, y > 1 where x alone would
// pass the device's 65535 limit. The kernel file declares WG.

struct FlatInvocation {
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
}

// The element this invocation handles.
fn flat_index(inv: FlatInvocation) -> u32 {
    return (inv.wid.x + inv.wid.y * inv.nwg.x) * WG + inv.lid;
}
