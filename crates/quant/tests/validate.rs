//! `validate` and `check_tensor_shapes` refuse malformed matrices with messages naming the fault.

mod common;

use common::*;
use half::bf16;
use quant::{check_tensor_shapes, validate, Bits, QMatRef, QShape, QuantError, QuantSpec};

fn err_of(r: Result<(), QuantError>) -> String {
    r.expect_err("should be refused").to_string()
}

#[test]
fn validate_accepts_good_and_refuses_bad() {
    let mut rng = Rng::new(21);
    let m = random_qmat(&mut rng, 4, 256, spec(Bits::B4, 64));
    validate(&m.as_ref()).unwrap();

    // wrong group size: the scales were written for group 128, the config says 64
    let msg = err_of(validate(&QMatRef {
        scales: &m.scales[..8],
        biases: &m.biases[..8],
        ..m.as_ref()
    }));
    assert!(
        msg.contains("scales length") && msg.contains("group_size 128"),
        "{msg}"
    );

    // missing scales / biases
    let msg = err_of(validate(&QMatRef {
        scales: &[],
        ..m.as_ref()
    }));
    assert!(msg.contains("missing scales"), "{msg}");
    let msg = err_of(validate(&QMatRef {
        biases: &[],
        ..m.as_ref()
    }));
    assert!(msg.contains("missing biases"), "{msg}");

    // short biases
    let msg = err_of(validate(&QMatRef {
        biases: &m.biases[..15],
        ..m.as_ref()
    }));
    assert!(
        msg.contains("biases length") && msg.contains("16") && msg.contains("15"),
        "{msg}"
    );

    // packed of the wrong size (e.g. 8-bit data under a 4-bit config)
    let msg = err_of(validate(&QMatRef {
        spec: spec(Bits::B8, 64),
        ..m.as_ref()
    }));
    assert!(
        msg.contains("packed length") && msg.contains("8 bits"),
        "{msg}"
    );

    // cols not a multiple of the group size, unsupported group size
    let msg = err_of(validate(&QMatRef {
        cols: 200,
        ..m.as_ref()
    }));
    assert!(
        msg.contains("200") && msg.contains("group_size 64"),
        "{msg}"
    );
    let msg = err_of(validate(&QMatRef {
        spec: spec(Bits::B4, 16),
        ..m.as_ref()
    }));
    assert!(msg.contains("group_size 16"), "{msg}");

    // QMatRef::new goes through the same checks
    assert!(QMatRef::new(
        4,
        256,
        spec(Bits::B4, 64),
        &m.packed,
        &m.scales[1..],
        &m.biases
    )
    .is_err());
}

#[test]
fn spec_new_refuses_unsupported() {
    assert_eq!(QuantSpec::new(3, 64), Err(QuantError::UnsupportedBits(3)));
    assert_eq!(
        QuantSpec::new(4, 100),
        Err(QuantError::UnsupportedGroupSize(100))
    );
    assert!(QuantSpec::new(8, 32).is_ok());
    assert!(QuantError::UnsupportedBits(3)
        .to_string()
        .contains("bits 3"));
}

#[test]
fn tensor_shapes() {
    let s4 = spec(Bits::B4, 64);
    // plain Linear [512, 2048] at 4 bits: weight [512, 256], scales/biases [512, 32]
    assert_eq!(
        check_tensor_shapes(s4, &[512, 256], Some(&[512, 32]), Some(&[512, 32])).unwrap(),
        QShape {
            experts: None,
            rows: 512,
            cols: 2048
        }
    );
    // stacked experts switch_mlp.down_proj [256, 2048, 512]: weight [256, 2048, 64], scales [256, 2048, 8]
    assert_eq!(
        check_tensor_shapes(
            s4,
            &[256, 2048, 64],
            Some(&[256, 2048, 8]),
            Some(&[256, 2048, 8])
        )
        .unwrap(),
        QShape {
            experts: Some(256),
            rows: 2048,
            cols: 512
        }
    );
    // router at 8 bits: [256, 2048] → weight [256, 512], scales [256, 32]
    let s8 = spec(Bits::B8, 64);
    assert_eq!(
        check_tensor_shapes(s8, &[256, 512], Some(&[256, 32]), Some(&[256, 32]))
            .unwrap()
            .cols,
        2048
    );

    let e = check_tensor_shapes(s4, &[512, 256], None, Some(&[512, 32]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing scales"), "{e}");
    let e = check_tensor_shapes(s4, &[512, 256], Some(&[512, 32]), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing biases"), "{e}");
    let e = check_tensor_shapes(s4, &[512, 256], Some(&[512, 16]), Some(&[512, 16]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("scales shape") && e.contains("implies group_size 128"),
        "{e}"
    );
    let e = check_tensor_shapes(s4, &[512, 256], Some(&[512, 32]), Some(&[511, 32]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("biases shape") && e.contains("[511, 32]"), "{e}");
    let e = check_tensor_shapes(s4, &[256, 512, 256], Some(&[512, 32]), Some(&[512, 32]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("scales shape") && e.contains("[256, 512, 32]"),
        "{e}"
    );
    let e = check_tensor_shapes(s4, &[2048], Some(&[32]), Some(&[32]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("weight rank"), "{e}");
    let e = check_tensor_shapes(s4, &[4, 3], Some(&[4, 0]), Some(&[4, 0]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("cols 24"), "{e}");
}

#[test]
#[should_panic(expected = "missing scales")]
fn kernels_panic_on_malformed_matrix() {
    let packed = vec![0u32; 8];
    let biases = vec![bf16::ZERO; 1];
    let m = QMatRef {
        rows: 1,
        cols: 64,
        spec: spec(Bits::B4, 64),
        packed: &packed,
        scales: &[],
        biases: &biases,
    };
    let mut out = [0f32; 1];
    quant::fast::gemv(&mut out, m, &[0.0; 64]);
}
