package jepsen

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"sort"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
)

// Nemesis is one kind of fault: Inject starts it and says what it did;
// Heal undoes it. The schedule never runs two at once.
type Nemesis interface {
	Name() string
	Inject(ctx context.Context, r *runner, rng *rand.Rand) (string, error)
	Heal(ctx context.Context, r *runner) error
}

// Nemeses are every nemesis by name.
var Nemeses = map[string]Nemesis{}

// DefaultNemeses is the mix a run uses unless told otherwise: all of them.
func DefaultNemeses() []string {
	var out []string
	for n := range Nemeses {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

func register(n Nemesis) { Nemeses[n.Name()] = n }

func init() {
	register(partition{"partition-halves", halves})
	register(partition{"partition-leader", isolateLeader})
	register(partition{"partition-client-replica", isolateClientFromOne})
	register(partition{"partition-ring", majorityRing})
	register(partition{"partition-oneway", oneWay})
	register(&kill{name: "kill-server"})
	register(&kill{name: "kill-leader", leader: true})
	register(killClient{})
	register(&pause{name: "pause-server"})
	register(&pause{name: "pause-leader", leader: true})
	register(&link{name: "link-slow", cmd: func(rng *rand.Rand) string {
		return fmt.Sprintf("delay %d %d", 20+rng.IntN(180), 50+rng.IntN(200))
	}})
	register(&link{name: "link-lossy", cmd: func(rng *rand.Rand) string {
		return fmt.Sprintf("reset %.3f", 0.005+rng.Float64()*0.02)
	}})
	register(&disk{name: "disk-errors", sig: syscall.SIGUSR1, what: "EIO"})
	register(&disk{name: "disk-full", sig: syscall.SIGXFSZ, what: "ENOSPC"})
	register(takeover{})
	register(expand{})
	register(rebuildFault{name: "rebuild-target"})
	register(rebuildFault{name: "rebuild-source", source: true})
	register(replaceReplica{})
	register(rebuildClient{})
	register(rebuildWrites{})
	register(flushStorm{})
	register(detachExpand{})
	register(detachSnapshot{})
	register(staleConnection{})
	register(&loseDisk{})
}

// partition installs nftables drops chosen by pick; Heal removes all.
type partition struct {
	name string
	pick func(ctx context.Context, r *runner, rng *rand.Rand) ([][2]*Host, bool, error)
}

func (p partition) Name() string { return p.name }

func (p partition) Inject(ctx context.Context, r *runner, rng *rand.Rand) (string, error) {
	pairs, oneway, err := p.pick(ctx, r, rng)
	if err != nil {
		return "", err
	}
	var desc []string
	pairs = slices.DeleteFunc(pairs, func(pr [2]*Host) bool { return r.c.colocated(pr[0], pr[1]) })
	if len(pairs) == 0 {
		return "no partition (the hosts picked are one machine)", nil
	}
	for _, pr := range pairs {
		if oneway {
			err = Drop(ctx, pr[0], pr[1])
			desc = append(desc, pr[0].Name+"->"+pr[1].Name)
		} else {
			err = Cut(ctx, pr[0], pr[1])
			desc = append(desc, pr[0].Name+"|"+pr[1].Name)
		}
		if err != nil {
			return "", err
		}
	}
	return "drop " + strings.Join(desc, " "), nil
}

func (p partition) Heal(ctx context.Context, r *runner) error { return r.c.Net.HealAll(ctx) }

// halves splits every host into two random halves.
func halves(_ context.Context, r *runner, rng *rand.Rand) ([][2]*Host, bool, error) {
	hosts := append([]*Host(nil), r.c.Net.Hosts...)
	rng.Shuffle(len(hosts), func(i, j int) { hosts[i], hosts[j] = hosts[j], hosts[i] })
	k := 1 + rng.IntN(len(hosts)-1)
	var out [][2]*Host
	for _, a := range hosts[:k] {
		for _, b := range hosts[k:] {
			out = append(out, [2]*Host{a, b})
		}
	}
	return out, false, nil
}

// isolateLeader cuts the Raft leader off from every other host.
func isolateLeader(ctx context.Context, r *runner, _ *rand.Rand) ([][2]*Host, bool, error) {
	l := r.c.Leader(ctx)
	if l == nil {
		return nil, false, errNoLeader
	}
	var out [][2]*Host
	for _, h := range r.c.Net.Hosts {
		if h != l.Host {
			out = append(out, [2]*Host{l.Host, h})
		}
	}
	return out, false, nil
}

var errNoLeader = errors.New("no leader right now")

// isolateClientFromOne cuts the active client host off from one server
// (not the one on its machine).
func isolateClientFromOne(_ context.Context, r *runner, rng *rand.Rand) ([][2]*Host, bool, error) {
	ch := r.active()
	others := slices.DeleteFunc(slices.Clone(r.c.Servers), func(s *Server) bool { return s == ch.Local })
	s := others[rng.IntN(len(others))]
	return [][2]*Host{{ch.Host, s.Host}}, false, nil
}

// majorityRing arranges every host in a random ring in which each sees
// only its two neighbours (with five hosts, each sees a majority).
func majorityRing(_ context.Context, r *runner, rng *rand.Rand) ([][2]*Host, bool, error) {
	hosts := append([]*Host(nil), r.c.Net.Hosts...)
	rng.Shuffle(len(hosts), func(i, j int) { hosts[i], hosts[j] = hosts[j], hosts[i] })
	n := len(hosts)
	var out [][2]*Host
	for i := range n {
		for j := i + 1; j < n; j++ {
			if d := j - i; d != 1 && d != n-1 {
				out = append(out, [2]*Host{hosts[i], hosts[j]})
			}
		}
	}
	return out, false, nil
}

// oneWay drops the packets of one random host to another (not back).
func oneWay(_ context.Context, r *runner, rng *rand.Rand) ([][2]*Host, bool, error) {
	hosts := r.c.Net.Hosts
	i := rng.IntN(len(hosts))
	j := (i + 1 + rng.IntN(len(hosts)-1)) % len(hosts)
	return [][2]*Host{{hosts[i], hosts[j]}}, true, nil
}

// kill sends SIGKILL to a random server or the leader; Heal restarts it.
type kill struct {
	name   string
	leader bool
	victim *Server
}

func (k *kill) Name() string { return k.name }

func (k *kill) Inject(ctx context.Context, r *runner, rng *rand.Rand) (string, error) {
	s, err := r.pickServer(ctx, rng, k.leader)
	if err != nil {
		return "", err
	}
	s.Proc.Kill()
	k.victim = s
	return "kill -9 " + s.ID, nil
}

func (k *kill) Heal(ctx context.Context, r *runner) error {
	if k.victim == nil {
		return nil
	}
	s := k.victim
	k.victim = nil
	return s.Proc.Start(false)
}

// killClient kills the active client's engine process; Heal starts a new
// one, which opens the volume at a new epoch.
type killClient struct{}

func (killClient) Name() string { return "kill-client" }

func (killClient) Inject(ctx context.Context, r *runner, rng *rand.Rand) (string, error) {
	ch := r.active()
	r.c.KillClient(ch)
	return "kill -9 the engine on " + ch.Host.Name, nil
}

func (killClient) Heal(ctx context.Context, r *runner) error {
	// The workers reopen the engine as soon as their requests fail; this
	// only makes sure it happens when they are all waiting.
	if s, _ := r.active().Session(); s != nil {
		return nil
	}
	if err := r.reopen(ctx, r.active()); err != nil && !errors.Is(err, errReopening) {
		return err
	}
	return nil
}

// pause stops a random server or the leader with SIGSTOP; Heal continues it.
type pause struct {
	name   string
	leader bool
	victim *Server
}

func (p *pause) Name() string { return p.name }

func (p *pause) Inject(ctx context.Context, r *runner, rng *rand.Rand) (string, error) {
	s, err := r.pickServer(ctx, rng, p.leader)
	if err != nil {
		return "", err
	}
	if err := s.Proc.Pause(); err != nil {
		return "", err
	}
	p.victim = s
	return "SIGSTOP " + s.ID, nil
}

func (p *pause) Heal(ctx context.Context, r *runner) error {
	if p.victim == nil {
		return nil
	}
	s := p.victim
	p.victim = nil
	return s.Proc.Resume()
}

// link makes one server's Raft and data links slow or lossy through its
// proxy.
type link struct {
	name   string
	cmd    func(*rand.Rand) string
	victim *Server
}

func (l *link) Name() string { return l.name }

func (l *link) Inject(ctx context.Context, r *runner, rng *rand.Rand) (string, error) {
	s := r.c.Servers[rng.IntN(len(r.c.Servers))]
	cmd := l.cmd(rng)
	if err := s.ProxyCommand(cmd); err != nil {
		return "", err
	}
	l.victim = s
	return cmd + " on " + s.ID, nil
}

func (l *link) Heal(ctx context.Context, r *runner) error {
	if l.victim == nil {
		return nil
	}
	s := l.victim
	l.victim = nil
	return s.ProxyCommand("ok")
}

// disk makes one server's replica store fail its writes and syncs: with
// EIO (disk-errors: SIGUSR1 to a stor-server built with the jepsenfaults
// tag) or ENOSPC, a full disk (disk-full: SIGXFSZ); SIGUSR2 ends either.
type disk struct {
	name   string
	sig    syscall.Signal
	what   string
	victim *Server
}

func (d *disk) Name() string { return d.name }

func (d *disk) Inject(ctx context.Context, r *runner, rng *rand.Rand) (string, error) {
	s := r.c.Servers[rng.IntN(len(r.c.Servers))]
	if err := s.Proc.Signal(d.sig); err != nil {
		return "", err
	}
	d.victim = s
	return d.what + " on replica writes and syncs on " + s.ID, nil
}

func (d *disk) Heal(ctx context.Context, r *runner) error {
	if d.victim == nil {
		return nil
	}
	s := d.victim
	d.victim = nil
	if !s.Proc.Running() {
		return nil
	}
	return s.Proc.Signal(syscall.SIGUSR2)
}

// loseDisk loses one server's disk under it: kill -9, its data dir
// wiped, started again on the empty dir, as when a claim is deleted or a
// disk replaced without the server being removed first. Not stor-0, the
// bootstrap ordinal (it refuses to start without state while a member),
// and only while every replica is healthy (a lost disk holding the last
// healthy copy loses data by design). The cluster must refuse the server
// on its new dir, make no replica there and serve nothing from it; Heal
// does what an operator does with a server the cluster refuses: once it
// is down (never seen since), removes it, after which it joins afresh
// and its replicas are replaced and rebuilt whole. A server the cluster
// admitted (seen since the wipe: the broken mode "admit-new-data-dirs")
// is left as it is.
type loseDisk struct {
	victim *Server
	at     time.Time
}

func (*loseDisk) Name() string { return "lose-disk" }

func (l *loseDisk) Inject(ctx context.Context, r *runner, rng *rand.Rand) (string, error) {
	v, err := r.volume(ctx)
	if err != nil {
		return "", err
	}
	if len(healthy(v)) != len(v.Replicas) || len(v.Replicas) < 3 {
		return "", errors.New("not every replica is healthy")
	}
	s := r.c.Servers[1+rng.IntN(len(r.c.Servers)-1)]
	s.Proc.Kill()
	l.victim = s
	err = os.RemoveAll(s.DataDir)
	if err == nil {
		err = os.MkdirAll(s.DataDir, 0o755)
	}
	// Started again whatever happened (a fault not injected is not
	// healed): what it last reported was before this.
	if serr := s.Proc.Start(false); err == nil {
		err = serr
	}
	l.at = time.Now()
	if err != nil {
		return "", fmt.Errorf("lose %s's disk: %w", s.ID, err)
	}
	return "kill -9 " + s.ID + ", its data dir wiped, started again", nil
}

func (l *loseDisk) Heal(ctx context.Context, r *runner) error {
	if l.victim == nil {
		return nil
	}
	s := l.victim
	l.victim = nil
	if !s.Proc.Running() {
		if err := s.Proc.Start(false); err != nil {
			return err
		}
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("%s after its disk was lost: neither seen nor down within 30 s", s.ID)
		}
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		resp, err := r.c.Control.Cluster.ListServers(cctx, &storpb.ListServersRequest{})
		cancel()
		if err != nil {
			continue
		}
		i := slices.IndexFunc(resp.Servers, func(x *storpb.Server) bool { return x.Id == s.ID })
		switch {
		case i < 0:
			return nil // removed already
		case resp.Servers[i].LastSeenUnixNano > l.at.UnixNano():
			return nil // admitted: seen since the wipe
		case resp.Servers[i].State != storpb.ServerState_SERVER_STATE_DOWN:
			continue
		}
		// Refused and down: the operator's way out, remove it (it joins
		// afresh by itself).
		cctx, cancel = context.WithTimeout(ctx, 5*time.Second)
		_, err = r.c.Control.Cluster.Leave(cctx, &storpb.LeaveRequest{ServerId: s.ID})
		cancel()
		if err == nil || status.Code(err) == codes.NotFound {
			return nil
		}
	}
}

// takeover is the fencing workload: another client host attaches the
// volume (a new epoch) and becomes the active one, while the old engine
// keeps trying to write for a while; every such write must be refused.
type takeover struct{}

func (takeover) Name() string { return "takeover" }

func (takeover) Inject(ctx context.Context, r *runner, rng *rand.Rand) (string, error) {
	old := r.active()
	next := r.c.Clients[(r.activeIdx()+1)%len(r.c.Clients)]
	// Switch first, so that the workers do not reopen the old host when
	// the new attach fences it.
	r.setActive(next)
	if err := r.reopen(ctx, next); err != nil {
		r.setActive(old)
		return "", err
	}
	r.staleWrites(old)
	return fmt.Sprintf("%s attaches the volume; the engine on %s is fenced and keeps writing", next.Host.Name, old.Host.Name), nil
}

func (takeover) Heal(ctx context.Context, r *runner) error { return nil }

// sigDiskHeal ends injected disk errors (see disk).
const sigDiskHeal = syscall.SIGUSR2

// maxBlocks caps online expansion (each adds one register).
const maxBlocks = 48

// expandVolume grows volume name to size within 10 s. The control plane
// refuses to expand a volume while a snapshot of it is not yet cut (the
// snapshotter's snapshots race this nemesis and detach-expand): that
// refusal is retried until the 10 s are over.
func expandVolume(ctx context.Context, volumes storpb.VolumeServiceClient, name string, size uint64) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for {
		_, err := volumes.ExpandVolume(ctx, &storpb.ExpandVolumeRequest{Volume: &storpb.VolumeRef{Name: name}, SizeBytes: size})
		if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "not yet cut") {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// expand grows the volume online by one register's stride while the
// workload runs, then writes and reads back a register in the new space
// through the engine: the engine must pick up the new size (from its watch
// stream) within 20 s. The new register joins the workload and the
// checkers like the others.
type expand struct{}

func (expand) Name() string { return "expand" }

func (expand) Inject(ctx context.Context, r *runner, rng *rand.Rand) (string, error) {
	n := r.blocks.Load()
	if n >= maxBlocks {
		return "", fmt.Errorf("the volume already has %d registers", n)
	}
	size := uint64(n+1) * blockStride
	if err := expandVolume(ctx, r.c.Control.Volumes, r.c.Volume, size); err != nil {
		return "", err
	}
	if err := r.addRegister(ctx, n, r.now()); err != nil {
		return "", fmt.Errorf("grown to %d bytes, but %w", size, err)
	}
	return fmt.Sprintf("grew the volume to %d MiB under load; register %d added", size>>20, n), nil
}

// addRegister writes register n (in space the volume just grew by, at
// grown) through the active engine until a write succeeds, for up to
// 20 s, and adds it to the workload either way. Until that write
// succeeds the register is not in the workers' range; its ops still go
// into the history, and the checkers judge it like the others.
func (r *runner) addRegister(ctx context.Context, n int64, grown int64) error {
	deadline := time.Now().Add(20 * time.Second)
	for {
		w := r.do(ctx, r.cfg.Workers+1, r.active(), "write", int(n))
		if w.OK {
			break
		}
		if time.Now().After(deadline) {
			r.blocks.Add(1)
			// Only an engine that serves the old space but not the new
			// one has failed to expand; one that serves nothing is
			// unavailable (counted in availability).
			if r.wroteSince(grown, int(n)) {
				r.expansionFailures.Add(1)
			}
			return fmt.Errorf("the engine still fails writes there: %s", w.Err)
		}
		sleep(ctx, 500*time.Millisecond)
	}
	r.blocks.Add(1)
	return nil
}

func (expand) Heal(ctx context.Context, r *runner) error { return nil }
