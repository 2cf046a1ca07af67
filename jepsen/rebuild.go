package jepsen

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
)

// Faults aimed at rebuilds. A replica that missed writes (its server was
// killed, cut off, its disk failed) comes back REBUILDING, and the engine
// copies into it from a healthy replica (the source) while the writes go
// on; ReplaceReplica adds a new replica that is filled by a full rebuild.
// These nemeses wait (bounded) until a replica is REBUILDING, as the
// control plane shows it, and fault the rebuild's target or its source
// mid-copy, then fault the retry again. The run's filler
// (RunConfig.FillBytes) makes each copy some 16 MiB, so that it lasts long
// enough to be hit, and while one of these nemeses runs the target's link
// is slowed (rebuildLinkDelay on its proxy), which stretches a copy that
// takes 0.1 s on an idle machine to a few seconds. Report.FaultHits
// counts the faults that landed while the control plane still showed the
// target REBUILDING.
//
// Reads go to the first healthy replica by id (engine.readSet), so a
// replica that comes back HEALTHY without writes it missed is seen at
// once when it is that one: half of the rebuilds these nemeses start are
// of that replica.

// Bounds of the rebuild nemeses.
const (
	// rebuildWait bounds each wait for a replica to become REBUILDING.
	rebuildWait = 20 * time.Second
	// rebuildDone bounds the wait for a replaced replica to be HEALTHY.
	rebuildDone = 30 * time.Second
	// rebuildLinkDelay is the link proxy command that slows the target
	// (each 64 KiB chunk forwarded waits 8-16 ms: some 16 MiB copied in
	// 2-4 s).
	rebuildLinkDelay = "delay 8 8"
)

// slowLink slows s's links for a rebuild nemesis; the returned func
// restores them.
func slowLink(s *Server) func() {
	if s == nil || s.ProxyCommand(rebuildLinkDelay) != nil {
		return func() {}
	}
	return func() { _ = s.ProxyCommand("ok") }
}

// volume returns the volume as the control plane has it now.
func (r *runner) volume(ctx context.Context) (*storpb.Volume, error) {
	cctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	resp, err := r.c.Control.Volumes.GetVolume(cctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Name: r.c.Volume}})
	if err != nil {
		return nil, err
	}
	return resp.Volume, nil
}

// server returns the Server with id id, or nil.
func (r *runner) server(id string) *Server {
	for _, s := range r.c.Servers {
		if s.ID == id {
			return s
		}
	}
	return nil
}

// waitReplica polls the volume every 50 ms, for up to limit, until pick
// returns a replica, and returns it.
func (r *runner) waitReplica(ctx context.Context, limit time.Duration, pick func(*storpb.Volume) *storpb.Replica) (*storpb.Replica, *storpb.Volume, error) {
	deadline := time.Now().Add(limit)
	var last error
	for ctx.Err() == nil && time.Now().Before(deadline) {
		v, err := r.volume(ctx)
		if err == nil {
			if rep := pick(v); rep != nil {
				return rep, v, nil
			}
		} else {
			last = err
		}
		sleep(ctx, 50*time.Millisecond)
	}
	return nil, nil, fmt.Errorf("not seen within %v (last error: %v)", limit, last)
}

// rebuilding picks a REBUILDING replica whose server is running: the one
// with id want if it is, else any.
func (r *runner) rebuilding(want string) func(*storpb.Volume) *storpb.Replica {
	return func(v *storpb.Volume) *storpb.Replica {
		var first *storpb.Replica
		for _, rep := range v.Replicas {
			s := r.server(rep.ServerId)
			if rep.State != storpb.ReplicaState_REPLICA_STATE_REBUILDING || s == nil || !s.Proc.Running() {
				continue
			}
			if rep.Id == want {
				return rep
			}
			if first == nil {
				first = rep
			}
		}
		return first
	}
}

func healthy(v *storpb.Volume) []*storpb.Replica {
	var out []*storpb.Replica
	for _, rep := range v.Replicas {
		if rep.State == storpb.ReplicaState_REPLICA_STATE_HEALTHY {
			out = append(out, rep)
		}
	}
	return out
}

// rebuildSource is the replica the engine copies from: the healthy
// replica on the engine's own machine (local, a server id or ""), else the
// first healthy replica by id (the engine's read order, engine.readSet).
// It is not in the control plane's view, so this mirrors the engine's
// rule; if the rule changes, the fault still lands on a healthy replica
// other than the target.
func rebuildSource(v *storpb.Volume, target, local string) *storpb.Replica {
	h := slices.DeleteFunc(healthy(v), func(rep *storpb.Replica) bool { return rep.Id == target })
	if len(h) == 0 {
		return nil
	}
	for _, rep := range h {
		if local != "" && rep.ServerId == local {
			return rep
		}
	}
	return slices.MinFunc(h, func(a, b *storpb.Replica) int { return strings.Compare(a.Id, b.Id) })
}

// localServer is the id of the server on the active client's machine, or
// "".
func (r *runner) localServer() string {
	if s := r.active().Local; s != nil {
		return s.ID
	}
	return ""
}

func replicaIn(v *storpb.Volume, id string) *storpb.Replica {
	for _, rep := range v.Replicas {
		if rep.Id == id {
			return rep
		}
	}
	return nil
}

// startRebuild makes a replica REBUILDING, unless one already is: it
// kills a random replica's server with SIGKILL for 1.5 s while the
// workers write (so that the replica misses writes and is marked faulty)
// and the cold registers are written, restarts it, and waits for the
// replica to come back REBUILDING (a delta rebuild of every region
// written meanwhile). The cold registers are not written again until the
// end of the nemesis, so a retry that skips what the first absence missed
// leaves them stale on the target.
func (r *runner) startRebuild(ctx context.Context, rng *rand.Rand) (*storpb.Replica, string, error) {
	v, err := r.volume(ctx)
	if err != nil {
		return nil, "", err
	}
	if rep := r.rebuilding("")(v); rep != nil {
		return rep, "", nil
	}
	var pre string
	if len(healthy(v)) == len(v.Replicas) {
		rep := v.Replicas[rng.IntN(len(v.Replicas))]
		if rng.IntN(2) == 0 {
			rep = slices.MinFunc(v.Replicas, func(a, b *storpb.Replica) int { return strings.Compare(a.Id, b.Id) })
		}
		s := r.server(rep.ServerId)
		if s == nil {
			return nil, "", fmt.Errorf("replica %s is on unknown server %s", rep.Id, rep.ServerId)
		}
		s.Proc.Kill()
		sleep(ctx, 500*time.Millisecond)
		cold := r.writeCold(ctx)
		sleep(ctx, 1000*time.Millisecond)
		// Slow before the restart, so that the copy is slow from its start.
		if err := s.ProxyCommand(rebuildLinkDelay); err != nil {
			return nil, "", err
		}
		if err := s.Proc.Start(false); err != nil {
			return nil, "", err
		}
		pre = fmt.Sprintf("kill -9 %s for 1.5 s to start a rebuild of %s (%d cold registers written meanwhile); ", s.ID, rep.Id, cold)
	}
	rep, _, err := r.waitReplica(ctx, rebuildWait, r.rebuilding(""))
	if err != nil {
		for _, s := range r.c.Servers {
			_ = s.ProxyCommand("ok")
		}
		return nil, pre, fmt.Errorf("%sno replica REBUILDING: %w", pre, err)
	}
	return rep, pre, nil
}

// faultServer kills s with SIGKILL or cuts it off from the active client
// host (the engine), holds that 1-2 s, and undoes it. A server on the
// engine's own machine cannot be cut off from it: it is killed.
func (r *runner) faultServer(ctx context.Context, rng *rand.Rand, s *Server, partition bool) (string, error) {
	hold := time.Duration(1000+rng.IntN(1000)) * time.Millisecond
	if partition && s != r.active().Local {
		ch := r.active()
		if err := Cut(ctx, ch.Host, s.Host); err != nil {
			return "", err
		}
		sleep(ctx, hold)
		return fmt.Sprintf("cut %s|%s for %v", ch.Host.Name, s.Host.Name, hold), r.c.Net.HealAll(ctx)
	}
	s.Proc.Kill()
	sleep(ctx, hold)
	return fmt.Sprintf("kill -9 %s for %v", s.ID, hold), s.Proc.Start(false)
}

// rebuildFault faults the server of a rebuild's target (source false) or
// of its source (source true) while the copy runs, 2-3 times: after each
// heal it waits for the retry to start and faults that too. Each fault is
// SIGKILL or a partition from the engine's host, chosen per round.
type rebuildFault struct {
	name   string
	source bool
}

func (n rebuildFault) Name() string { return n.name }

func (n rebuildFault) Inject(ctx context.Context, r *runner, rng *rand.Rand) (string, error) {
	target, desc, err := r.startRebuild(ctx, rng)
	if err != nil {
		return "", err
	}
	defer slowLink(r.server(target.ServerId))()
	rounds := 2 + rng.IntN(2)
	var done []string
	for i := 0; i < rounds; i++ {
		if i > 0 {
			// The retry: the same replica REBUILDING again (or, if the
			// first was given up, another).
			pick := r.rebuilding(target.Id)
			if n.source {
				// The source faulted last round is faulty now; wait until
				// it is healthy again (its own rebuild) while a rebuild
				// runs, so that there is a source to fault that is not
				// the last healthy replica.
				pick = func(v *storpb.Volume) *storpb.Replica {
					if len(healthy(v)) < 2 {
						return nil
					}
					return r.rebuilding(target.Id)(v)
				}
			}
			var err error
			if target, _, err = r.waitReplica(ctx, rebuildWait, pick); err != nil {
				done = append(done, fmt.Sprintf("round %d: no retry REBUILDING: %v", i+1, err))
				break
			}
		}
		// Into the copy: the engine starts it as soon as its watch shows
		// the replica REBUILDING.
		sleep(ctx, time.Duration(rng.IntN(300))*time.Millisecond)
		v, err := r.volume(ctx)
		if err != nil {
			return "", err
		}
		now := replicaIn(v, target.Id)
		if now == nil {
			done = append(done, fmt.Sprintf("round %d: %s was removed", i+1, target.Id))
			break
		}
		victim := now
		if n.source {
			if victim = rebuildSource(v, target.Id, r.localServer()); victim == nil || len(healthy(v)) < 2 {
				// Faulting the only healthy replica would stop the volume,
				// not test the rebuild.
				done = append(done, fmt.Sprintf("round %d: fewer than two healthy replicas", i+1))
				break
			}
		}
		s := r.server(victim.ServerId)
		if s == nil || !s.Proc.Running() {
			done = append(done, fmt.Sprintf("round %d: %s not running", i+1, victim.ServerId))
			break
		}
		mid := now.State == storpb.ReplicaState_REPLICA_STATE_REBUILDING
		what, err := r.faultServer(ctx, rng, s, rng.IntN(2) == 0)
		if err != nil {
			return "", err
		}
		role := "target"
		if n.source {
			role = "source"
		}
		state := "after it finished"
		if mid {
			state = fmt.Sprintf("mid-copy (%d/%d bytes reported)", now.RebuildDoneBytes, now.RebuildTotalBytes)
			kind := "kill"
			if strings.HasPrefix(what, "cut") {
				kind = "partition"
			}
			r.hit(fmt.Sprintf("%s: %s of the rebuild's %s while it was REBUILDING", n.name, kind, role))
		}
		done = append(done, fmt.Sprintf("round %d: %s (%s %s of %s, delta from generation %d) %s", i+1, what, role, victim.Id, target.Id, now.RebuildFromGeneration, state))
	}
	return desc + strings.Join(done, "; ") + r.checkColdAfterRebuilds(ctx), nil
}

// checkColdAfterRebuilds waits (up to rebuildDone) for every replica to be
// HEALTHY and then reads the cold registers from each (ops
// "replica-check", checkReplicasHoldLastWrite): the next rebuild nemesis
// writes them again, which would hide what this one's rebuilds left from
// the final checks. It returns what it did, for the fault's description.
func (r *runner) checkColdAfterRebuilds(ctx context.Context) string {
	_, v, err := r.waitReplica(ctx, rebuildDone, func(v *storpb.Volume) *storpb.Replica {
		if len(v.Replicas) > 0 && len(healthy(v)) == len(v.Replicas) {
			return v.Replicas[0]
		}
		return nil
	})
	if err != nil {
		return fmt.Sprintf("; not every replica HEALTHY within %v: cold registers not checked", rebuildDone)
	}
	if err := r.readHealthyReplicas(ctx, v, "replica-check", 0, r.cold); err != nil {
		return fmt.Sprintf("; cold registers not read: %v", err)
	}
	return "; every replica HEALTHY, the cold registers read from each"
}

// Heal is nothing: each round heals its own fault.
func (rebuildFault) Heal(ctx context.Context, r *runner) error { return nil }

// replaceReplica replaces a healthy replica under load (ReplaceReplica,
// as stor-ctl replica remove --replace does), faults the new replica's
// server mid-copy (SIGKILL or a partition from the engine) once or twice,
// heals, and waits (bounded) for the new replica to complete its full
// rebuild. With as many servers as replicas a replacement has nowhere to
// go but the server it leaves, which placement refuses: then it is a
// remove and an add on that server (two ReplaceReplica calls, as stor-ctl
// replica remove and replica add), still a brand-new replica filled by a
// full rebuild. Each removal is a "replica-remove" op; one the control
// plane refuses because the replica holds the last copy of a snapshot
// (FailedPrecondition) ends the round as a failed op, not a harness error.
type replaceReplica struct{}

func (replaceReplica) Name() string { return "replace-replica" }

func (replaceReplica) Inject(ctx context.Context, r *runner, rng *rand.Rand) (string, error) {
	v, err := r.volume(ctx)
	if err != nil {
		return "", err
	}
	if len(healthy(v)) != len(v.Replicas) || len(v.Replicas) < 3 {
		return "", errors.New("not every replica is healthy")
	}
	old := v.Replicas[rng.IntN(len(v.Replicas))]
	before := map[string]bool{}
	for _, rep := range v.Replicas {
		before[rep.Id] = true
	}
	ref := &storpb.VolumeRef{Name: r.c.Volume}
	call := func(req *storpb.ReplaceReplicaRequest) error {
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		_, err := r.c.Control.Volumes.ReplaceReplica(cctx, req)
		return err
	}
	// Cold registers the new replica must get from its copy alone: no
	// write covers them afterwards.
	cold := r.writeCold(ctx)
	desc := fmt.Sprintf("%d cold registers written; replace %s on %s", cold, old.Id, old.ServerId)
	// With three servers the new replica goes where the old one was.
	defer slowLink(r.server(old.ServerId))()
	// remove records the removal as a "replica-remove" op; the control
	// plane may refuse it (FailedPrecondition: old holds the last copy of
	// a snapshot), which is a failed op, not a harness error.
	remove := func(req *storpb.ReplaceReplicaRequest) (refused bool, err error) {
		o := Op{Client: -1, Kind: "replica-remove", Replica: old.Id, Call: r.now()}
		err = call(req)
		o.Return, o.OK = r.now(), err == nil
		if err != nil {
			o.Err = err.Error()
		}
		r.record(o)
		return status.Code(err) == codes.FailedPrecondition, err
	}
	refusedDesc := func(err error) string {
		r.hit("replace-replica: removal refused")
		return fmt.Sprintf("%s: removal refused: %s", desc, status.Convert(err).Message())
	}
	if refused, err := remove(&storpb.ReplaceReplicaRequest{Volume: ref, ReplicaId: old.Id}); refused {
		return refusedDesc(err), nil
	} else if err != nil {
		if refused, err := remove(&storpb.ReplaceReplicaRequest{Volume: ref, ReplicaId: old.Id, RemoveOnly: true}); refused {
			return refusedDesc(err), nil
		} else if err != nil {
			return "", fmt.Errorf("remove %s: %w", old.Id, err)
		}
		if err := call(&storpb.ReplaceReplicaRequest{Volume: ref, ServerId: old.ServerId}); err != nil {
			// The volume runs with one replica fewer; the leader's
			// repair adds one back in time.
			return "", fmt.Errorf("removed %s, but adding one on %s: %w", old.Id, old.ServerId, err)
		}
		desc = fmt.Sprintf("%d cold registers written; remove %s and add a replica on %s (no other server)", cold, old.Id, old.ServerId)
	}
	fresh := func(v *storpb.Volume) *storpb.Replica {
		for _, rep := range v.Replicas {
			if !before[rep.Id] {
				return rep
			}
		}
		return nil
	}
	added, _, err := r.waitReplica(ctx, 5*time.Second, fresh)
	if err != nil {
		return "", fmt.Errorf("%s: the new replica: %w", desc, err)
	}
	desc += "; new replica " + added.Id
	rounds := 1 + rng.IntN(2)
	for i := 0; i < rounds; i++ {
		rep, _, err := r.waitReplica(ctx, rebuildWait, func(v *storpb.Volume) *storpb.Replica {
			if rep := r.rebuilding(added.Id)(v); rep != nil && rep.Id == added.Id {
				return rep
			}
			return nil
		})
		if err != nil {
			desc += fmt.Sprintf("; round %d: not REBUILDING: %v", i+1, err)
			break
		}
		sleep(ctx, time.Duration(rng.IntN(300))*time.Millisecond)
		v, err := r.volume(ctx)
		if err != nil {
			return "", err
		}
		now := replicaIn(v, rep.Id)
		mid := now != nil && now.State == storpb.ReplicaState_REPLICA_STATE_REBUILDING
		what, err := r.faultServer(ctx, rng, r.server(rep.ServerId), rng.IntN(2) == 0)
		if err != nil {
			return "", err
		}
		state := "after it finished"
		if mid {
			state = fmt.Sprintf("mid-copy (%d/%d bytes reported, full from offset %d)", now.RebuildDoneBytes, now.RebuildTotalBytes, now.RebuildResumeOffset)
			r.hit("replace-replica: fault of the new replica while it was REBUILDING")
		}
		desc += fmt.Sprintf("; round %d: %s %s", i+1, what, state)
	}
	if _, _, err := r.waitReplica(ctx, rebuildDone, func(v *storpb.Volume) *storpb.Replica {
		if rep := replicaIn(v, added.Id); rep != nil && rep.State == storpb.ReplicaState_REPLICA_STATE_HEALTHY {
			return rep
		}
		return nil
	}); err != nil {
		return desc + fmt.Sprintf("; not HEALTHY within %v", rebuildDone), nil
	}
	return desc + "; HEALTHY again", nil
}

func (replaceReplica) Heal(ctx context.Context, r *runner) error { return nil }

// rebuildWrites writes the cold registers while a rebuild copies them: it
// starts a rebuild as the other rebuild nemeses do (the target's link is
// slowed from before its restart, so the copy of the run's some Blocks MiB
// lasts seconds; the source's link is slowed as well), then writes each cold register once, in a random order
// at random moments over the copy's expected length, and waits for the
// target to be HEALTHY. Nothing writes a cold register afterwards, so if a
// copy and a write to the same block interleave (the copy read the
// source's block before the write and wrote it to the target after), the
// target keeps the older block for good. Once the target is HEALTHY the
// cold registers are read from every HEALTHY replica (ops "replica-check",
// checkReplicasHoldLastWrite): each must hold its register's last write.
// The next rebuild nemesis writes the cold registers again, so that check
// is what sees each rebuild's outcome; the divergence checker reads every
// replica at the end, and the workers' reads see it when the target is the
// replica they read from (issue 13, C).
type rebuildWrites struct{}

func (rebuildWrites) Name() string { return "rebuild-writes" }

func (rebuildWrites) Inject(ctx context.Context, r *runner, rng *rand.Rand) (string, error) {
	target, desc, err := r.startRebuild(ctx, rng)
	if err != nil {
		return "", err
	}
	defer slowLink(r.server(target.ServerId))()
	// The source's link is slowed too: a copy reads a chunk from the source
	// and then writes it to the target, so a write issued while that read
	// is on its way reaches the target before the copy does. The slower
	// the read, the wider the window in which the copy and a write to its
	// block can interleave, unless the engine orders them.
	if v, err := r.volume(ctx); err == nil {
		if src := rebuildSource(v, target.Id, r.localServer()); src != nil {
			defer slowLink(r.server(src.ServerId))()
		}
	}
	// The copy goes through the registers' strides in order, about a MiB
	// each; register b's is copied at about b strides into the copy. Each
	// cold register is written once, at a random moment within the time
	// its own stride is expected to be copied (the last copy's pace, once
	// one was measured; 250 ms a stride on the slowed links before: the
	// engine copies several chunks at once).
	copyStart := time.Now()
	per := r.copyPerBlock
	if per == 0 {
		per = 250 * time.Millisecond
	}
	// The copy's pace is measured from when the target turns HEALTHY, not
	// from when the writes below are done: they may outlast a copy faster
	// than the last one, and a pace measured after them would never
	// shrink again (the writes would come later and later after the copy).
	healthyAt := make(chan time.Duration, 1)
	pollCtx, stopPoll := context.WithCancel(ctx)
	defer stopPoll()
	go func() {
		for {
			if v, err := r.volume(pollCtx); err == nil {
				if now := replicaIn(v, target.Id); now != nil && now.State == storpb.ReplicaState_REPLICA_STATE_HEALTHY {
					healthyAt <- time.Since(copyStart)
					return
				}
			}
			select {
			case <-pollCtx.Done():
				return
			case <-time.After(50 * time.Millisecond):
			}
		}
	}()
	type plan struct {
		b  int
		at time.Duration
	}
	var writes []plan
	for b := range r.cfg.Blocks {
		if r.cold(b) {
			at := time.Duration(b)*per + time.Duration(rng.Int64N(int64(per)))
			writes = append(writes, plan{b, at})
		}
	}
	slices.SortFunc(writes, func(x, y plan) int { return cmp.Compare(x.at, y.at) })
	written, during := 0, 0
	for _, w := range writes {
		sleep(ctx, w.at-time.Since(copyStart))
		if ctx.Err() != nil {
			break
		}
		if r.do(ctx, r.cfg.Workers+1, r.active(), "write", w.b).OK {
			written++
			if v, err := r.volume(ctx); err == nil {
				if now := replicaIn(v, target.Id); now != nil && now.State == storpb.ReplicaState_REPLICA_STATE_REBUILDING {
					during++
				}
			}
		}
	}
	if during > 0 {
		r.hit("rebuild-writes: cold register written while the target was REBUILDING")
	}
	_, v, werr := r.waitReplica(ctx, rebuildDone, func(v *storpb.Volume) *storpb.Replica {
		if now := replicaIn(v, target.Id); now != nil && now.State == storpb.ReplicaState_REPLICA_STATE_HEALTHY {
			return now
		}
		return nil
	})
	end := "the target is HEALTHY"
	if werr != nil {
		end = fmt.Sprintf("the target is not HEALTHY: %v", werr)
	} else {
		took := time.Since(copyStart)
		stopPoll()
		select {
		case took = <-healthyAt:
		default:
		}
		r.copyPerBlock = took / time.Duration(max(r.cfg.Blocks, 1))
		end += fmt.Sprintf(" (%v a register's stride)", r.copyPerBlock.Round(time.Millisecond))
		// Each rebuild's outcome is checked before the next fault writes
		// the cold registers again (which would hide it from the final
		// checks): every HEALTHY replica, the target among them, must hold
		// the last write to each cold register (checkReplicasHoldLastWrite).
		if err := r.readHealthyReplicas(ctx, v, "replica-check", 0, r.cold); err != nil {
			end += fmt.Sprintf("; the replicas were not read: %v", err)
		} else {
			end += "; the cold registers read from every HEALTHY replica"
		}
	}
	return fmt.Sprintf("%s%d cold registers written during the copy of %s (%d seen while it was REBUILDING); %s", desc, written, target.Id, during, end), nil
}

// Heal is nothing: the link is restored when Inject returns.
func (rebuildWrites) Heal(ctx context.Context, r *runner) error { return nil }
