package jepsen

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
)

// staleConnection makes the sequence of bug 5 (docs/JEPSEN.md): writes an
// engine gave up on with their connection reach the replica after its new
// incarnation was rebuilt. It holds every data connection open now to one
// replica's server in that server's link proxy (proxy command "hold": a
// path that is stuck while new connections take another) for 7-8 s and,
// at once, writes every cold register (all together, each on a client of
// its own). The writes wait in the proxy; the engine's I/O timeout
// (engineIOTimeout) gives the replica up, records it faulty and closes the
// connection (its close waits in the proxy behind them); the replica comes
// back REBUILDING and the engine joins it on a new connection, which is
// not held, and rebuilds it. As soon as the control plane shows it back,
// the cold registers are written again. When the hold ends, the proxy
// delivers the old connection's writes. Once every replica is HEALTHY the
// cold registers are read from every replica (ops "replica-check",
// checkReplicasHoldLastWrite): a replica that applied the old writes holds
// each cold register's first value, older than its last acknowledged
// write. Servers refuse requests of an attach handle older than the
// replica's newest (wire's doc, "Incarnations"); the broken mode
// "stale-incarnations" lets them serve.
//
// Bug 5 was found with a cut of 4.2 s instead: the writes were queued in
// the engine's kernel, which delivered them at TCP's next retransmission
// after the heal. A cut does that only now and then (in 1 of 4 seeds of
// the broken mode): when the server's end has replies to retransmit too
// and sends first, the engine's closed socket answers with a reset and
// its queue is dropped.
type staleConnection struct{}

func (staleConnection) Name() string { return "stale-connection" }

func (staleConnection) Inject(ctx context.Context, r *runner, rng *rand.Rand) (string, error) {
	v, err := r.volume(ctx)
	if err != nil {
		return "", err
	}
	if r.cfg.ColdBlocks <= 0 {
		return "", errors.New("no cold registers")
	}
	if len(v.Replicas) < 3 || len(healthy(v)) != len(v.Replicas) {
		return "", errors.New("not every replica is healthy")
	}
	rep := v.Replicas[rng.IntN(len(v.Replicas))]
	s := r.server(rep.ServerId)
	if s == nil || !s.Proc.Running() {
		return "", fmt.Errorf("replica %s's server %s is not running", rep.Id, rep.ServerId)
	}
	hold := time.Duration(7000+rng.IntN(1000)) * time.Millisecond
	if err := s.ProxyCommand(fmt.Sprintf("hold %d %d", hold.Milliseconds(), portDataProxy)); err != nil {
		return "", err
	}
	held := time.Now()
	first := r.writeColdTogether(ctx)
	desc := fmt.Sprintf("hold %s's data connections for %v, %d cold registers written meanwhile", s.ID, hold, first)
	// Back: no longer FAULTY, at a later generation than before the hold
	// (so it was recorded faulty in between).
	back, _, err := r.waitReplica(ctx, rebuildWait, func(v *storpb.Volume) *storpb.Replica {
		now := replicaIn(v, rep.Id)
		if now != nil && now.Generation > rep.Generation && now.State != storpb.ReplicaState_REPLICA_STATE_FAULTY {
			return now
		}
		return nil
	})
	if err != nil {
		return desc + fmt.Sprintf("; %s not back: %v", rep.Id, err), nil
	}
	at := time.Since(held)
	second := r.writeColdTogether(ctx)
	desc += fmt.Sprintf("; %s back %v after (%v), the cold registers written again (%d) %v after", rep.Id,
		at.Round(time.Millisecond), back.State, second, time.Since(held).Round(time.Millisecond))
	if time.Since(held) < hold {
		r.hit("stale-connection: the cold registers written again before the old connection's writes were delivered")
	}
	sleep(ctx, hold+time.Second-time.Since(held))
	return desc + r.checkColdAfterRebuilds(ctx), nil
}

// Heal is nothing: Inject heals its own cut.
func (staleConnection) Heal(ctx context.Context, r *runner) error { return nil }

// writeColdTogether writes every cold register once, all at the same time,
// each on a client of its own (Workers+2+i, as flush-storm's), and returns
// how many writes were acknowledged.
func (r *runner) writeColdTogether(ctx context.Context) int {
	var wg sync.WaitGroup
	var n atomic.Int32
	i := 0
	for b := range r.cfg.Blocks {
		if !r.cold(b) {
			continue
		}
		client := r.cfg.Workers + 2 + i
		i++
		wg.Add(1)
		go func() {
			defer wg.Done()
			if r.do(ctx, client, r.active(), "write", b).OK {
				n.Add(1)
			}
		}()
	}
	wg.Wait()
	return int(n.Load())
}
