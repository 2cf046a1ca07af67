package attach

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

// OOMScoreAdj is the oom_score_adj PrepareProcess asks for: the OOM
// killer spares the process unless nothing else is left (-1000 would
// exempt it entirely; other userspace block servers, open-iscsi's iscsid
// and NBD daemons, choose similar values).
const OOMScoreAdj = -900

// Process is the process-wide settings of a process that serves the
// kernel's block devices from userspace. RealProcess changes the running
// process; tests fake it.
type Process struct {
	// SetIOFlusher sets PR_SET_IO_FLUSHER (prctl 57, Linux 5.6 or newer;
	// needs CAP_SYS_RESOURCE).
	SetIOFlusher func() error
	// SetOOMScoreAdj writes /proc/self/oom_score_adj (lowering it needs
	// CAP_SYS_RESOURCE).
	SetOOMScoreAdj func(adj int) error
}

// RealProcess is the running process.
func RealProcess() Process {
	return Process{
		SetIOFlusher: func() error { return unix.Prctl(unix.PR_SET_IO_FLUSHER, 1, 0, 0, 0) },
		SetOOMScoreAdj: func(adj int) error {
			return os.WriteFile("/proc/self/oom_score_adj", []byte(strconv.Itoa(adj)), 0)
		},
	}
}

// PrepareProcess readies this process to sit in its own node's writeback
// path. A page the kernel writes back to /dev/nbdN is written by this
// process; if serving it needs memory the kernel can only get by writing
// back more pages to the same device, the node deadlocks. PR_SET_IO_FLUSHER
// makes the kernel allocate for this process as for a filesystem's own
// writeback (no recursion into I/O for reclaim, a throttling exemption);
// a low oom_score_adj keeps the OOM killer from choosing the process that
// would free the memory by finishing the writeback.
//
// A setting the kernel refuses (EPERM without CAP_SYS_RESOURCE, EINVAL
// before Linux 5.6) is logged with what it costs and serving goes on:
// the result is every refusal, nil when both took.
func PrepareProcess(p Process, log *slog.Logger) error {
	if log == nil {
		log = slog.Default()
	}
	var errs []error
	switch err := p.SetIOFlusher(); {
	case err == nil:
		log.Info("PR_SET_IO_FLUSHER set: this process serves the kernel's writeback")
	case errors.Is(err, unix.EINVAL):
		errs = append(errs, fmt.Errorf("attach: PR_SET_IO_FLUSHER: %w (a kernel before 5.6)", err))
	case errors.Is(err, unix.EPERM):
		errs = append(errs, fmt.Errorf("attach: PR_SET_IO_FLUSHER: %w (needs CAP_SYS_RESOURCE)", err))
	default:
		errs = append(errs, fmt.Errorf("attach: PR_SET_IO_FLUSHER: %w", err))
	}
	if err := p.SetOOMScoreAdj(OOMScoreAdj); err != nil {
		errs = append(errs, fmt.Errorf("attach: oom_score_adj %d: %w", OOMScoreAdj, err))
	} else {
		log.Info("oom_score_adj set", "adj", OOMScoreAdj)
	}
	for _, err := range errs {
		log.Warn("serving the kernel without a writeback safeguard; under memory pressure writeback to this node's devices may stall or the OOM killer may pick this process", "err", err)
	}
	return errors.Join(errs...)
}
