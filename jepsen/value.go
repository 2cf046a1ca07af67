package jepsen

import (
	"crypto/sha256"
	"encoding/binary"
	"math/rand/v2"
)

// BlockSize is the size of one register: one block of the volume.
const BlockSize = 4096

// blockStride spaces the registers 1 MiB apart, so that they fall in
// different regions of the replicas' dirty-region logs.
const blockStride = 1 << 20

// A register value is a whole block that names itself:
//
//	[0:8)    the writing operation's id (unique in the run, never 0)
//	[8:16)   the block's index
//	[16:24)  the run's seed
//	[24:4064) bytes derived from the three
//	[4064:4096) SHA-256 of [0:4064)
//
// A block of zeroes is the initial value (0). Anything else that does not
// check out is torn (a mix of writes) or foreign (another block's or
// another run's value).
func encodeValue(id uint64, block int, seed uint64) []byte {
	b := make([]byte, BlockSize)
	binary.LittleEndian.PutUint64(b[0:], id)
	binary.LittleEndian.PutUint64(b[8:], uint64(block))
	binary.LittleEndian.PutUint64(b[16:], seed)
	r := rand.NewPCG(id, uint64(block)^seed)
	for i := 24; i+8 <= BlockSize-32; i += 8 {
		binary.LittleEndian.PutUint64(b[i:], r.Uint64())
	}
	sum := sha256.Sum256(b[:BlockSize-32])
	copy(b[BlockSize-32:], sum[:])
	return b
}

// decode sets a read's Value from the block it returned, or Bad (and Raw,
// the bytes) when they are not a value of its block.
func (o *Op) decode(data []byte, seed uint64) {
	o.Value, o.Bad = decodeValue(data, o.Block, seed)
	if o.Bad != "" {
		o.Raw = data
	}
}

// decodeValue returns the op id a block holds (0 for zeroes), or a reason
// it is not a value this run wrote to this block.
func decodeValue(b []byte, block int, seed uint64) (uint64, string) {
	if len(b) != BlockSize {
		return 0, "short read"
	}
	zero := true
	for _, c := range b {
		if c != 0 {
			zero = false
			break
		}
	}
	if zero {
		return 0, ""
	}
	sum := sha256.Sum256(b[:BlockSize-32])
	if string(sum[:]) != string(b[BlockSize-32:]) {
		return 0, "torn: checksum mismatch"
	}
	id := binary.LittleEndian.Uint64(b[0:])
	switch {
	case binary.LittleEndian.Uint64(b[16:]) != seed:
		return 0, "foreign: another run's value"
	case binary.LittleEndian.Uint64(b[8:]) != uint64(block):
		return 0, "foreign: another block's value"
	case id == 0:
		return 0, "foreign: op id 0"
	}
	return id, ""
}
