package jepsen

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
)

// Faults around a detach. While a nemesis holds the volume detached the
// workers do not reopen it (runner.held): their requests fail (a closed
// engine) or reach the zombie engine that was left open.

// detachExpand: the client detaches cleanly (the engine flushes, closes
// and detaches the volume, as a clean unstage does), the volume is
// expanded while detached (offline), and the client reattaches (a new
// epoch); a register in the new space then joins the workload, like an
// online expansion's. In two of three, one server misses the expansion
// (killed -9 across it, or cut off from the other servers until the new
// register was written), so that its replica may still have the old size
// when the engine opens.
type detachExpand struct{}

func (detachExpand) Name() string { return "detach-expand" }

func (detachExpand) Inject(ctx context.Context, r *runner, rng *rand.Rand) (string, error) {
	n := r.blocks.Load()
	if n >= maxBlocks {
		return "", fmt.Errorf("the volume already has %d registers", n)
	}
	ch := r.active()
	s, epoch := ch.Session()
	if s == nil {
		return "", errors.New("no client process")
	}
	r.held.Store(true)
	defer r.held.Store(false)
	o := Op{Client: -1, Host: ch.Name, Kind: "detach", Epoch: epoch, Call: r.now()}
	cctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	resp, err := s.Call(cctx, Request{Op: "detach", TimeoutMS: 15000})
	cancel()
	o.Return, o.OK = r.now(), err == nil && resp.OK
	switch {
	case err != nil:
		o.Err = err.Error()
	case !resp.OK:
		o.Err = resp.Kind + ": " + resp.Err
	}
	r.record(o)
	if !o.OK {
		return "", errors.Join(fmt.Errorf("detach: %s", o.Err), r.reattach(ctx, ch))
	}
	// In two of three, one server misses the expansion: it is down while
	// the volume grows and comes back just before the reattach, or it is
	// cut off from the other servers (not from the client) until the new
	// register was written, so its replica may still have the old size
	// when the engine opens.
	var down, apart *Server
	switch rng.IntN(3) {
	case 0:
		down = r.c.Servers[rng.IntN(len(r.c.Servers))]
		down.Proc.Kill()
	case 1:
		apart = r.c.Servers[rng.IntN(len(r.c.Servers))]
		for _, o := range r.c.Servers {
			if o != apart {
				if err := Cut(ctx, apart.Host, o.Host); err != nil {
					return "", errors.Join(err, r.c.Net.HealAll(ctx), r.reattach(ctx, ch))
				}
			}
		}
		defer func() { _ = r.c.Net.HealAll(ctx) }()
	}
	size := uint64(n+1) * blockStride
	volumes := r.c.Control.Volumes
	if apart != nil {
		// The harness's control client may be pinned to the server cut
		// off, which answers "no leader" until healed: ask the others.
		var addrs []string
		for _, o := range r.c.Servers {
			if o != apart {
				addrs = append(addrs, o.ControlAddr())
			}
		}
		c, err := r.c.DialControl(addrs)
		if err != nil {
			return "", errors.Join(err, r.c.Net.HealAll(ctx), r.reattach(ctx, ch))
		}
		defer c.Close()
		volumes = c.Volumes
	}
	err = expandVolume(ctx, volumes, r.c.Volume, size)
	var restart error
	if down != nil {
		restart = down.Proc.Start(false)
	}
	if err != nil || restart != nil {
		if err != nil {
			err = fmt.Errorf("expanding the detached volume: %w", err)
		}
		return "", errors.Join(err, restart, r.c.Net.HealAll(ctx), r.reattach(ctx, ch))
	}
	grown := r.now()
	during := ""
	switch {
	case down != nil:
		during = fmt.Sprintf(" (%s killed -9 meanwhile, restarted before the reattach)", down.ID)
	case apart != nil:
		during = fmt.Sprintf(" (%s cut off from the other servers meanwhile, until the new register was written)", apart.ID)
	}
	attached := false
	if apart != nil {
		// One try while it is cut off; a server cut off from its peers
		// answers "no leader", and a control client that asked it may not
		// ask another (seen with seed 110): then heal first.
		if attached = r.reopen(ctx, ch) == nil; !attached {
			if err := r.c.Net.HealAll(ctx); err != nil {
				return "", err
			}
		}
	}
	if !attached {
		if err := r.reattach(ctx, ch); err != nil {
			return "", fmt.Errorf("grown to %d bytes while detached, but reattaching: %w", size, err)
		}
	}
	r.held.Store(false)
	if err := r.addRegister(ctx, n, grown); err != nil {
		return "", fmt.Errorf("grown to %d bytes while detached and reattached, but %w", size, err)
	}
	return fmt.Sprintf("%s detached at epoch %d; the volume grew to %d MiB offline%s; reattached; register %d added", ch.Host.Name, epoch, size>>20, during, n), nil
}

func (detachExpand) Heal(ctx context.Context, r *runner) error { return nil }

// reattach opens the volume on ch again (a new epoch), up to three times.
func (r *runner) reattach(ctx context.Context, ch *ClientHost) error {
	var err error
	for i := 0; i < 3; i++ {
		if err = r.reopen(ctx, ch); err == nil || errors.Is(err, errReopening) {
			return nil
		}
		sleep(ctx, time.Second)
	}
	return err
}

// detachSnapshot: the control plane detaches the volume from the active
// client (as a CSI ControllerUnpublish does when the node is gone) while
// the engine there, opened before the detach, goes on writing (a zombie:
// the workers, and a writer of its own for 3 s); the harness snapshots
// the detached volume (the servers cut each replica), clones the
// snapshot, and reattaches the client (a new epoch).
//
// The snapshot is checked like every other one, with its window from the
// detach call to the moment it was seen ready: it must hold every write
// acknowledged before the detach, and be one instant on every replica.
// A detached cut fences the replicas first, so from the moment the
// snapshot is ready the zombie must not have another write acknowledged:
// a "fence" op records that for the fencing checker.
type detachSnapshot struct{}

func (detachSnapshot) Name() string { return "detach-snapshot" }

func (detachSnapshot) Inject(ctx context.Context, r *runner, rng *rand.Rand) (string, error) {
	ch := r.active()
	if s, _ := ch.Session(); s == nil {
		return "", errors.New("no client process")
	}
	_, epoch := ch.Session()
	r.held.Store(true)
	defer r.held.Store(false)
	r.staleWrites(ch)
	sleep(ctx, time.Duration(rng.IntN(300))*time.Millisecond)
	o := Op{Client: -1, Host: ch.Name, Kind: "detach", Epoch: epoch, Call: r.now()}
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	_, err := r.c.Control.Volumes.DetachVolume(cctx, &storpb.DetachVolumeRequest{Volume: &storpb.VolumeRef{Name: r.c.Volume}, NodeId: ch.Name})
	cancel()
	o.Return, o.OK = r.now(), err == nil
	if err != nil {
		o.Err = err.Error()
	}
	r.record(o)
	if err != nil {
		return "", errors.Join(fmt.Errorf("detach: %w", err), r.reattach(ctx, ch))
	}
	name := fmt.Sprintf("jepsen-detached-%d", o.Call/int64(time.Millisecond))
	desc := fmt.Sprintf("detached the volume from %s at epoch %d (its engine keeps writing)", ch.Host.Name, epoch)
	snap := r.snapshot(ctx, name, o.Call)
	if snap == nil {
		desc += "; snapshot " + name + " of the detached volume not ready"
	} else {
		r.record(Op{Client: -1, Host: ch.Name, Kind: "fence", Epoch: epoch, Call: o.Call, Return: snap.ready, OK: true})
		desc += "; snapshot " + name + " of the detached volume ready"
		if !r.cfg.NoClones {
			r.clone(ctx, snap, name+"-clone")
			desc += ", cloned"
		}
	}
	if err := r.reattach(ctx, ch); err != nil {
		return "", fmt.Errorf("%s; reattaching: %w", desc, err)
	}
	return desc + "; reattached", nil
}

func (detachSnapshot) Heal(ctx context.Context, r *runner) error { return nil }
