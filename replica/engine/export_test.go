package engine

import storpb "github.com/stor-io/stor/api/proto"

// AddNewReplicas runs the engine's join of v's REBUILDING replicas, as the
// watch and retryJoins do, for tests of stale views.
func AddNewReplicas(e *Engine, v *storpb.Volume) bool { return e.addNewReplicas(v) }
