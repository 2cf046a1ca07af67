package jepsen

import (
	"cmp"
	"fmt"
	"maps"
	"math"
	"slices"
	"sort"
	"time"

	"github.com/anishathalye/porcupine"
)

// Op is one operation in a run's history. Times are nanoseconds since the
// run began.
type Op struct {
	Client int    `json:"client"`
	Host   string `json:"host"`  // the client host that ran it
	Epoch  uint64 `json:"epoch"` // the engine epoch that ran it (0: unknown)
	Kind   string `json:"kind"`  // write, read, flush, open, detach, fence, final-read, snapshot, snapshot-delete, clone, snapshot-read, snapshot-lost, replica-remove, replica-read, replica-check, reconcile-read
	Block  int    `json:"block"`
	// Snapshot names the snapshot of a snapshot op; Replica the replica a
	// snapshot-read read from; Clone the clone of the snapshot it read, if
	// it read a clone's replica rather than the snapshot's layer.
	Snapshot string `json:"snapshot,omitempty"`
	Clone    string `json:"clone,omitempty"`
	Replica  string `json:"replica,omitempty"`
	// Value: a write's op id; a read's result (op id, 0 for zeroes).
	Value  uint64 `json:"value"`
	Call   int64  `json:"call"`
	Return int64  `json:"return"`
	OK     bool   `json:"ok"`
	Err    string `json:"err,omitempty"`
	// Bad says why a read's content is not a value of this block.
	Bad string `json:"bad,omitempty"`
	// Round groups the reconcile-read ops of one look at the replicas.
	Round int `json:"round,omitempty"`
	// Raw is the content of a bad read, for diagnosis (regenerate any
	// write's content with encodeValue to compare sector by sector).
	Raw []byte `json:"raw,omitempty"`
}

// Anomalies are what the checkers found, by checker.
type Anomalies struct {
	Linearizability int      `json:"linearizability"` // blocks whose history is not linearizable
	Durability      int      `json:"durability"`      // flushed acknowledged writes missing after the restart
	Integrity       int      `json:"integrity"`       // torn or foreign block contents read
	Fencing         int      `json:"fencing"`         // writes acknowledged by a fenced engine
	Expansion       int      `json:"expansion"`       // online expansions the engine never served
	Snapshot        int      `json:"snapshot"`        // findings that a snapshot or clone is not the volume at one point of its window
	Divergence      int      `json:"divergence"`      // registers whose healthy replicas hold different values after the final reopen, or an older value than the last write after a rebuild
	Unknown         int      `json:"unknown"`         // blocks porcupine could not decide in time
	Details         []string `json:"details,omitempty"`
}

// Total counts the anomalies (Unknown is not one, but fails a run too).
func (a Anomalies) Total() int {
	return a.Linearizability + a.Durability + a.Integrity + a.Fencing + a.Expansion + a.Snapshot + a.Divergence
}

type regInput struct {
	Write bool
	Value uint64
}

// registerModel is a single-block register; the history is partitioned by
// block beforehand. Failed writes are given an infinite return time, as
// etcd's robustness tests do: they may take effect at any later point, or
// never.
var registerModel = porcupine.Model{
	Init: func() interface{} { return uint64(0) },
	Step: func(state, input, output interface{}) (bool, interface{}) {
		in := input.(regInput)
		if in.Write {
			return true, in.Value
		}
		return output.(uint64) == state.(uint64), state
	},
	DescribeOperation: func(input, output interface{}) string {
		in := input.(regInput)
		if in.Write {
			return fmt.Sprintf("write(%d)", in.Value)
		}
		return fmt.Sprintf("read() -> %d", output.(uint64))
	},
	DescribeState: func(state interface{}) string { return fmt.Sprint(state.(uint64)) },
}

// porcupineHistory turns one block's reads and writes into porcupine
// operations: acknowledged writes and reads as they happened, failed
// writes as indeterminate, failed reads dropped (they observed nothing).
//
// Two reductions keep the search small without changing the verdict. A
// failed write whose value no read returned is dropped: "it never took
// effect" is one of its allowed outcomes, and since nobody read its value
// the next operation after it could only be a write, so taking effect
// cannot help any read. A failed write whose value was read must have
// taken effect before the first such read returned, so that is its
// return time.
func porcupineHistory(ops []Op, block int) []porcupine.Operation {
	seen := map[uint64]int64{} // value -> earliest return of a read of it
	for _, o := range ops {
		if o.Block == block && o.Kind == "read" && o.OK && o.Bad == "" && o.Value != 0 {
			if t, ok := seen[o.Value]; !ok || o.Return < t {
				seen[o.Value] = o.Return
			}
		}
	}
	var out []porcupine.Operation
	for _, o := range ops {
		if o.Block != block || o.Bad != "" {
			continue
		}
		switch {
		case o.Kind == "write":
			ret := o.Return
			if !o.OK {
				t, read := seen[o.Value]
				if !read {
					continue
				}
				ret = t
			}
			out = append(out, porcupine.Operation{ClientId: o.Client, Input: regInput{Write: true, Value: o.Value}, Call: o.Call, Output: uint64(0), Return: ret})
		case o.Kind == "read" && o.OK:
			out = append(out, porcupine.Operation{ClientId: o.Client, Input: regInput{}, Call: o.Call, Output: o.Value, Return: o.Return})
		}
	}
	return out
}

// checkLinearizable checks every block, with the snapshots' contents
// (from checkSnapshots) as reads; for each one that fails it writes
// porcupine's visualization to visualize(block). A block that fails only
// with the snapshots' reads is a snapshot anomaly.
func checkLinearizable(ops, snapReads []Op, blocks int, timeout time.Duration, visualize func(block int) string, a *Anomalies) {
	all := append(append([]Op(nil), ops...), snapReads...)
	for b := range blocks {
		h := porcupineHistory(all, b)
		res, info := porcupine.CheckOperationsVerbose(registerModel, h, timeout)
		switch res {
		case porcupine.Ok:
		case porcupine.Illegal:
			path := visualize(b)
			if err := porcupine.VisualizePath(registerModel, info, path); err != nil {
				path = "(visualization failed: " + err.Error() + ")"
			}
			plain := porcupineHistory(ops, b)
			if len(plain) < len(h) && porcupine.CheckOperationsTimeout(registerModel, plain, timeout) == porcupine.Ok {
				a.Snapshot++
				a.Details = append(a.Details, fmt.Sprintf("snapshot: block %d is linearizable, but not with the snapshots' contents as reads in their windows; see %s", b, path))
				continue
			}
			a.Linearizability++
			a.Details = append(a.Details, fmt.Sprintf("linearizability: block %d is not linearizable (%d ops); see %s", b, len(h), path))
		default:
			a.Unknown++
			a.Details = append(a.Details, fmt.Sprintf("linearizability: block %d undecided within %v (%d ops)", b, timeout, len(h)))
		}
	}
}

// checkIntegrity counts reads of torn or foreign contents.
func checkIntegrity(ops []Op, a *Anomalies) {
	for _, o := range ops {
		if o.Bad != "" {
			a.Integrity++
			what := fmt.Sprintf("%s of block %d by client %d at %v", o.Kind, o.Block, o.Client, time.Duration(o.Call))
			if o.Kind == "snapshot-read" {
				what = fmt.Sprintf("block %d of snapshot %s on replica %s", o.Block, groupName(o), o.Replica)
			}
			a.Details = append(a.Details, fmt.Sprintf("integrity: %s: %s", what, o.Bad))
		}
	}
}

// checkFencing: once an open at epoch e has returned, no engine at an
// epoch below e may acknowledge a write it was asked to do after that.
// A "fence" op at epoch e (the volume was detached from the engine at e,
// and a cut of the detached volume, which fences its replicas, was done
// by its Return) counts as an open at e+1: the engine at e is a zombie
// from then on.
func checkFencing(ops []Op, a *Anomalies) {
	type open struct {
		epoch uint64
		at    int64
	}
	var opens []open
	for _, o := range ops {
		switch {
		case o.Kind == "open" && o.OK:
			opens = append(opens, open{o.Epoch, o.Return})
		case o.Kind == "fence" && o.OK:
			opens = append(opens, open{o.Epoch + 1, o.Return})
		}
	}
	for _, w := range ops {
		if w.Kind != "write" || !w.OK || w.Epoch == 0 {
			continue
		}
		for _, op := range opens {
			if op.epoch > w.Epoch && op.at < w.Call {
				a.Fencing++
				a.Details = append(a.Details, fmt.Sprintf("fencing: write %d to block %d by %s at epoch %d (called %v) was acknowledged after epoch %d was opened or fenced (%v)",
					w.Value, w.Block, w.Host, w.Epoch, time.Duration(w.Call), op.epoch, time.Duration(op.at)))
				break
			}
		}
	}
}

// checkReplicasAgree: after the full restart and the final open (which
// reconciles what an unclean stop left dirty), with nothing written since,
// every healthy replica holds the same value in every register (the
// "replica-read" ops, one per replica and register). Replicas that differ
// are two versions of a block kept for good: which one a read gets depends
// on which replica it goes to.
func checkReplicasAgree(ops []Op, a *Anomalies) {
	replicasAgree(ops, "replica-read", func(int) string { return "after the final open" }, a)
}

// checkReconciledReplicasAgree: right after an engine that was killed
// with writes in flight is reopened (its reconcile done: a kill in a
// flush storm), with nothing writing the cold registers, every healthy
// replica holds the same value in each (the "reconcile-read" ops of one
// Round). Either version of a write the kill left on some replicas only
// is allowed, but one for all: replicas that differ are what the
// reconcile should have made the same.
func checkReconciledReplicasAgree(ops []Op, a *Anomalies) {
	replicasAgree(ops, "reconcile-read", func(round int) string { return fmt.Sprintf("after the reconcile of look %d", round) }, a)
}

// replicasAgree counts a divergence for every register whose ops of kind
// kind in one Round read different values on different replicas; when
// says when that Round looked.
func replicasAgree(ops []Op, kind string, when func(round int) string, a *Anomalies) {
	type look struct{ round, block int }
	seen := map[look]map[uint64][]string{} // -> value -> replicas
	for _, o := range ops {
		if o.Kind != kind || !o.OK || o.Bad != "" {
			continue
		}
		k := look{o.Round, o.Block}
		if seen[k] == nil {
			seen[k] = map[uint64][]string{}
		}
		seen[k][o.Value] = append(seen[k][o.Value], o.Replica)
	}
	looks := slices.SortedFunc(maps.Keys(seen), func(x, y look) int {
		return cmp.Or(cmp.Compare(x.round, y.round), cmp.Compare(x.block, y.block))
	})
	for _, k := range looks {
		if len(seen[k]) > 1 {
			a.Divergence++
			a.Details = append(a.Details, fmt.Sprintf("divergence: block %d %s: %v (value: replicas)", k.block, when(k.round), seen[k]))
		}
	}
}

// checkReplicasHoldLastWrite: a "replica-check" op reads a register from
// one HEALTHY replica directly, at a moment nothing writes it (the cold
// registers once a rebuild-writes rebuild is over). It must hold the
// register's last write: the write called last before the check, if every
// write to that register called before the check was acknowledged before
// the check began and before that last write was called (no write in
// flight, none failed, none concurrent: otherwise either value may be
// right and the register is left out). A HEALTHY replica holding an older
// value lost an acknowledged write: a read that goes to it returns it.
func checkReplicasHoldLastWrite(ops []Op, a *Anomalies) {
	writes := map[int][]Op{} // block -> writes, in history order
	for _, o := range ops {
		if o.Kind == "write" {
			writes[o.Block] = append(writes[o.Block], o)
		}
	}
	for _, c := range ops {
		if c.Kind != "replica-check" || !c.OK || c.Bad != "" {
			continue
		}
		var before []Op
		for _, w := range writes[c.Block] {
			if w.Call < c.Call {
				before = append(before, w)
			}
		}
		if len(before) == 0 {
			continue
		}
		last := slices.MaxFunc(before, func(x, y Op) int { return cmp.Compare(x.Call, y.Call) })
		clear := true
		for _, w := range before {
			if !w.OK || w.Return >= c.Call || (w.Value != last.Value && w.Return >= last.Call) {
				clear = false
				break
			}
		}
		if clear && c.Value != last.Value {
			a.Divergence++
			a.Details = append(a.Details, fmt.Sprintf("divergence: block %d on HEALTHY replica %s holds %d at %v, but write %d was acknowledged at %v and nothing wrote the block since",
				c.Block, c.Replica, c.Value, time.Duration(c.Call), last.Value, time.Duration(last.Return)))
		}
	}
}

// checkDurability: after the full restart (the "final-read" ops), each
// block must hold a value that is not older than the newest write
// acknowledged before a flush that completed: it must be that write, or a
// write that was not over before that write began.
func checkDurability(ops []Op, blocks int, a *Anomalies) {
	var flushes []int64 // call times of completed flushes
	for _, o := range ops {
		if o.Kind == "flush" && o.OK {
			flushes = append(flushes, o.Call)
		}
	}
	sort.Slice(flushes, func(i, j int) bool { return flushes[i] < flushes[j] })
	lastFlush := int64(math.MinInt64)
	if len(flushes) > 0 {
		lastFlush = flushes[len(flushes)-1]
	}
	writes := map[uint64]Op{}
	for _, o := range ops {
		if o.Kind == "write" {
			writes[o.Value] = o
		}
	}
	for b := range blocks {
		// The durable write of b that began last.
		var durable *Op
		for _, o := range ops {
			if o.Kind == "write" && o.Block == b && o.OK && o.Return < lastFlush {
				if durable == nil || o.Call > durable.Call {
					o := o
					durable = &o
				}
			}
		}
		var final *Op
		for _, o := range ops {
			if o.Kind == "final-read" && o.Block == b && o.OK && o.Bad == "" {
				o := o
				final = &o
			}
		}
		if final == nil {
			a.Durability++
			a.Details = append(a.Details, fmt.Sprintf("durability: block %d could not be read after the restart", b))
			continue
		}
		if durable == nil {
			continue
		}
		if final.Value == 0 {
			a.Durability++
			a.Details = append(a.Details, fmt.Sprintf("durability: block %d reads zeroes after the restart; write %d was acknowledged and flushed", b, durable.Value))
			continue
		}
		w, ok := writes[final.Value]
		if !ok || w.Block != b {
			a.Durability++
			a.Details = append(a.Details, fmt.Sprintf("durability: block %d holds %d after the restart, which no write to it carried", b, final.Value))
			continue
		}
		if w.Value != durable.Value && w.OK && w.Return < durable.Call {
			a.Durability++
			a.Details = append(a.Details, fmt.Sprintf("durability: block %d holds write %d after the restart, older than the flushed write %d", b, w.Value, durable.Value))
		}
	}
}

// checkSnapshotLosses counts the snapshots seen ready whose copies all
// went with replicas that left the volume ("snapshot-lost" ops). A loss
// the control plane recorded (OK: the snapshot is failed and its entries
// say LOST) is a reported limitation and only counted; one it did not
// record (the snapshot turned not-ready without a LOST copy) is a silent
// loss, a snapshot anomaly. A ready listing whose CUT copy does not read
// back is checkSnapshots' to report.
func checkSnapshotLosses(ops []Op, a *Anomalies) (lost int) {
	for _, o := range ops {
		if o.Kind != "snapshot-lost" {
			continue
		}
		if o.OK {
			lost++
			continue
		}
		a.Snapshot++
		a.Details = append(a.Details, fmt.Sprintf("snapshot: %s: seen ready at %v, no longer ready and no copy recorded lost: %s",
			o.Snapshot, time.Duration(o.Call), o.Err))
	}
	return lost
}

// checkSnapshots: a ready snapshot must be the volume as it was at one
// point of its window (from the CreateSnapshot call to the moment it was
// seen ready), on every replica that cut it. For each snapshot it checks
// that every replica that cut it could be read and that they agree block
// by block; then that some single time t in the window is consistent with
// every block's value x at once: t must be after x's write was called,
// and before any acknowledged write to that block that began after x's
// write was acknowledged (or, for x = zeroes, before any acknowledged
// write to the block) had returned. Torn or foreign contents are left to
// checkIntegrity.
//
// It returns each passing snapshot's contents as reads whose interval is
// the window narrowed that way; checkLinearizable adds them to the
// blocks' histories, so a snapshot must also agree with what reads saw.
func checkSnapshots(ops []Op, a *Anomalies) []Op {
	writes := map[uint64]Op{}
	acked := map[int][]Op{} // block -> acknowledged writes
	for _, o := range ops {
		if o.Kind == "write" {
			writes[o.Value] = o
			if o.OK {
				acked[o.Block] = append(acked[o.Block], o)
			}
		}
	}
	// A group is one snapshot's layers, or one clone's replicas.
	var names []string
	reads := map[string][]Op{}
	for _, o := range ops {
		if o.Kind == "snapshot-read" {
			key := groupName(o)
			if reads[key] == nil {
				names = append(names, key)
			}
			reads[key] = append(reads[key], o)
		}
	}
	contents := map[string]map[int]uint64{} // group -> what it holds, when it checked out
	var extra []Op
	for k, name := range names {
		bad := func(format string, args ...any) {
			a.Snapshot++
			a.Details = append(a.Details, fmt.Sprintf("snapshot: %s: ", name)+fmt.Sprintf(format, args...))
		}
		rs := reads[name]
		lo, hi := rs[0].Call, rs[0].Return
		loWhy, hiWhy := "it was requested at "+time.Duration(lo).String(), "it was seen ready at "+time.Duration(hi).String()
		values := map[int]uint64{}
		unreadable := map[string]bool{}
		failed := false
		for _, o := range rs {
			switch {
			case !o.OK:
				if !unreadable[o.Replica] {
					unreadable[o.Replica] = true
					bad("replica %s cut it but its layer cannot be read: %s", o.Replica, o.Err)
				}
				failed = true
			case o.Bad != "":
				failed = true
			default:
				if v, ok := values[o.Block]; ok && v != o.Value {
					bad("replicas disagree on block %d: %d and %d (replica %s)", o.Block, v, o.Value, o.Replica)
					failed = true
				} else if !ok {
					values[o.Block] = o.Value
				}
			}
		}
		blocks := slices.Sorted(maps.Keys(values))
		for _, b := range blocks {
			x := values[b]
			xRet := int64(math.MinInt64)
			if x != 0 {
				w, ok := writes[x]
				if !ok || w.Block != b {
					bad("block %d holds %d, which no write to it carried", b, x)
					failed = true
					continue
				}
				if w.Call > lo {
					lo, loWhy = w.Call, fmt.Sprintf("block %d holds write %d, which was called at %v", b, x, time.Duration(w.Call))
				}
				if !w.OK {
					continue // indeterminate: it may have been the value until the end
				}
				xRet = w.Return
			}
			for _, y := range acked[b] {
				if y.Value != x && y.Call > xRet && y.Return < hi {
					hi, hiWhy = y.Return, fmt.Sprintf("block %d holds %d although write %d, begun after that was over, was acknowledged at %v",
						b, x, y.Value, time.Duration(y.Return))
				}
			}
		}
		if lo >= hi {
			bad("not the volume at any one point of its window: %s, but %s", loWhy, hiWhy)
			continue
		}
		if failed {
			continue
		}
		contents[name] = values
		for _, b := range blocks {
			extra = append(extra, Op{Client: snapshotClient + k, Kind: "read", Snapshot: name, Block: b, Value: values[b], Call: lo, Return: hi, OK: true})
		}
	}
	// A clone must hold its snapshot's contents, block for block.
	for _, name := range names {
		o := reads[name][0]
		if o.Clone == "" {
			continue
		}
		clone, snap := contents[name], contents[o.Snapshot]
		if clone == nil || snap == nil {
			continue // reported above, or the snapshot was deleted (the clone was then checked on its own)
		}
		for _, b := range slices.Sorted(maps.Keys(clone)) {
			if v, ok := snap[b]; ok && v != clone[b] {
				a.Snapshot++
				a.Details = append(a.Details, fmt.Sprintf("snapshot: %s: block %d holds %d, its snapshot %d", name, b, clone[b], v))
			}
		}
	}
	return extra
}

// groupName names the snapshot, or the clone of a snapshot, that a
// snapshot-read read.
func groupName(o Op) string {
	if o.Clone != "" {
		return fmt.Sprintf("%s (clone %s)", o.Snapshot, o.Clone)
	}
	return o.Snapshot
}

// snapshotClient is the porcupine client id of the first snapshot's reads.
const snapshotClient = 1000
